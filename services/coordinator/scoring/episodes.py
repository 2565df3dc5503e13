"""The coordinator's side of multi-turn episodes (`core.episodes`, issue 40): the run's
environment in its sandboxed processes (`services.environments.runner.EnvRunner`), asked for each
episode's opening and, when a model turn ends, for its answer; the answer rendered as the model
reads it (`tasks.chat.PromptEncoder.observation`) and handed to the step's `EpisodeTable`, which
gives the next turn's continuation job or finishes the episode.

Environments are functions of the row and the history: the turns and what the environment said
so far are read back from the table (`EpisodeTable.turns`, `Episode.said`), so a turn that ends
after a coordinator restart, or on another shard process, is answered the same way. A call that
fails ends its episode with the rewards so far (counted, as reward errors are, and handed back to
be told); whether the failures stop the run is `core.call_errors`' to say, never this shell's.

An episode takes at most `max_turns` model turns: the spec's `episode.max_turns` when set, else
the environment's own (`protocol.effective_max_turns`), said once in the log.
"""

import asyncio
import logging
import time

from prometheus_client import Counter
from tokenizers import Tokenizer

from services.contracts.messages import Job
from services.contracts.runspec import RunSpec
from services.coordinator.settings import EnvironmentLimits
from services.core.episodes import EpisodeStats, EpisodeTable, Observation
from services.environments.choice import EnvironmentChoice
from services.environments.protocol import Feedback, Turn, effective_max_turns
from services.environments.runner import EnvRunner, StepResult
from services.environments.tool_calls import parse_turn
from services.tasks.base import Example
from services.tasks.chat import PromptEncoder

log = logging.getLogger(__name__)
TURNS = Counter("spotrl_coordinator_turns_total", "Model turns of multi-turn episodes answered")
EPISODES = Counter("spotrl_coordinator_episodes_total", "Multi-turn episodes over")
TOOL_CALLS = Counter(
    "spotrl_coordinator_tool_calls_total", "Tool calls parsed from model turns", ["outcome"]
)


async def open_environment(spec: RunSpec, limits: EnvironmentLimits) -> EnvRunner | None:
    """The run's environment processes, started; None for a single-turn run."""
    name = spec.episode.environment
    if name is None:
        return None
    runner = EnvRunner(
        EnvironmentChoice(name),
        allowed_modules=limits.modules,
        processes=limits.processes,
        call_timeout_s=spec.episode.environment_timeout_s,
        memory_limit_mb=limits.memory_limit_mb,
        allow_network=limits.allow_network,
    )
    await runner.start()
    return runner


class EpisodeShell:
    def __init__(
        self,
        runner: EnvRunner,
        spec: RunSpec,
        prompts: PromptEncoder,
        tokenizer: Tokenizer,
        stop_ids: list[int],
    ) -> None:
        self.runner, self.prompts, self.tokenizer = runner, prompts, tokenizer
        self.stop_ids = set(stop_ids)
        self.tool_format = spec.episode.tool_format
        self.max_turns, why = effective_max_turns(spec.episode.max_turns, runner.max_turns)
        log.info("episodes take at most %d model turns: %s", self.max_turns, why)

    async def openings(self, examples: list[Example]) -> list[str]:
        """Each episode's first message (an opening that fails falls back to the row's prompt,
        counted)."""
        results = await asyncio.gather(*(self.runner.opening(e.row) for e in examples))
        return [r.text if not r.error else e.prompt for r, e in zip(results, examples, strict=True)]

    async def answer(
        self, table: EpisodeTable, examples: list[Example], rids: list[str], stats: EpisodeStats
    ) -> tuple[list[Job], list[str], list[StepResult]]:
        """The environment's answers to the turns of `rids` that ended, observed in `table`:
        the next turns' jobs, the episodes now over, and the calls that failed."""
        asked = [rid for rid in rids if table.requests[rid].awaiting is not None]
        if not asked:
            return [], [], []
        histories = await asyncio.to_thread(self._histories, table, asked)
        started = time.monotonic()
        results = await asyncio.gather(
            *(
                self.runner.step(examples[table.requests[rid].prompt_index].row, turns, said)
                for rid, (turns, said) in zip(asked, histories, strict=True)
            )
        )
        stats.seconds += time.monotonic() - started
        answers = await asyncio.to_thread(self._observations, table, asked, results)
        jobs, over = [], []
        for rid, (turns, _), result, answer in zip(asked, histories, results, answers, strict=True):
            self._count(stats, turns[-1], result)
            job = table.observe(rid, table.requests[rid].lease, answer)
            if job is not None:
                jobs.append(job)
            elif table.requests[rid].done:
                over.append(rid)
                stats.episodes += 1
                EPISODES.inc()
        return jobs, over, [result for result in results if result.error]

    def _histories(
        self, table: EpisodeTable, rids: list[str]
    ) -> list[tuple[list[Turn], list[Feedback]]]:
        """Each episode's turns as the environment reads them, and what it said to each but
        the last (CPU: in a thread)."""
        out = []
        for rid in rids:
            texts = self.tokenizer.decode_batch(
                [[t for t in turn if t not in self.stop_ids] for turn in table.turns(rid)]
            )
            turns = [parse_turn(text, self.tool_format) for text in texts]
            episode = table.episodes[rid]
            said = [
                Feedback(text, reward, role=role)  # type: ignore[arg-type]
                for (role, text), reward in zip(episode.said, episode.rewards, strict=True)
            ]
            out.append((turns, said))
        return out

    def _observations(
        self, table: EpisodeTable, rids: list[str], results: list[StepResult]
    ) -> list[Observation]:
        """Each answer as the table takes it: the observation's tokens as the model reads them
        (none when the episode is over, or when the last turn is the run's last)."""
        out = []
        for rid, result in zip(rids, results, strict=True):
            fb, r = result.feedback, table.requests[rid]
            done = fb.done or table.episodes[rid].turns >= self.max_turns
            tokens: list[int] = []
            if not done:
                last = r.token_ids[-1] if r.token_ids else None
                stop = (
                    self.tokenizer.decode([last], skip_special_tokens=False)
                    if (last in self.stop_ids)
                    else ""
                )
                tokens = self.prompts.encode_observation(fb.role, fb.observation, stop)
            out.append(Observation(tokens, fb.reward, done, fb.observation, fb.role))
        return out

    @staticmethod
    def _count(stats: EpisodeStats, turn: Turn, result: StepResult) -> None:
        failed = result.feedback.tool_errors + len(turn.parse_errors)
        stats.turns += 1
        stats.tool_calls += len(turn.tool_calls)
        stats.tool_errors += failed
        TURNS.inc()
        TOOL_CALLS.labels("called").inc(len(turn.tool_calls))
        TOOL_CALLS.labels("failed").inc(failed)
        if result.error:
            stats.errors += 1
            stats.by_error[result.error] = stats.by_error.get(result.error, 0) + 1

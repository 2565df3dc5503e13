"""Scoring a run's responses without ever blocking or stopping the coordinator.

A reward that may hang or crash (a user function, a pattern from the spec, sympy) runs in reward
processes that the runner kills and starts again when a call takes longer than the spec's
`reward_timeout_s` or kills its process; exact and numeric matches run in a thread. A call that
raises, hangs, crashes its process or returns no finite number scores 0 and is counted
(`spotrl_coordinator_reward_errors_total{kind}`, and per step by the caller); only a reward that
cannot be loaded at all is an error (RewardLoadError).

A reward process is this module run as a child (`services.infra.child_process`):
`python -m services.coordinator.scoring.rewards`. It loads the run's reward (importing a user
function's module there, never in the coordinator), then scores the batches it is sent. What the
two say to each other, each message a frame (`services.infra.frames`):

    runner -> process: `LoadReward` once, then `ScoreBatch`es.
    process -> runner: `Loaded` once, then one `reward_choice.Outcome` per call of a batch, in
    order, each as soon as it is known: a call that takes too long is the one after the last
    outcome received.

It may be killed at any moment (a call that hangs) and dies with the coordinator. What user code
prints goes to the coordinator's log (stderr), never into the frames.
"""

import abc
import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import msgspec
from prometheus_client import Counter

from services.environments.sandbox import user_code_environ
from services.infra.child_process import ChildGone, ChildProcess, take_pipes, tie_to_parent
from services.infra.frames import read_frame, write_frame
from services.tasks.base import Example, TaskError
from services.tasks.reward_choice import (
    CRASHED,
    ERROR_KINDS,
    TIMEOUT,
    Outcome,
    RewardChoice,
    RewardLoadError,
    call_reward,
    describe,
)

log = logging.getLogger(__name__)
REWARD_ERRORS = Counter(
    "spotrl_coordinator_reward_errors_total",
    "Reward calls scored 0 because the reward raised, timed out, crashed its process or "
    "returned no finite number",
    ["kind"],
)
ERRORS = {kind: REWARD_ERRORS.labels(kind) for kind in ERROR_KINDS}
LOAD_TIMEOUT_S = 60.0  # to import a user reward's module
Call = tuple[Example, str]  # an example and a decoded response


class LoadReward(msgspec.Struct, frozen=True):
    name: str  # a built-in's name, or module.path:function
    answer_regex: str | None
    tolerance: float


class Loaded(msgspec.Struct, frozen=True):
    error: str = ""  # why the reward could not be loaded; empty when it was


class ScoreBatch(msgspec.Struct, frozen=True):
    examples: list[tuple[str, str, dict[str, Any]]]  # prompt, answer, row
    calls: list[tuple[int, str]]  # index into examples, decoded response


class RewardProcess:
    """One reward process, with the reward loaded; started again after a call hung or
    crashed it."""

    def __init__(self, choice: RewardChoice, timeout_s: float) -> None:
        self.choice, self.timeout_s = choice, timeout_s
        # its own process group (a kill takes its children too), none of this service's
        # credentials in its environment
        self.child = ChildProcess(
            "services.coordinator.scoring.rewards",
            env=user_code_environ,
            pipes=True,
            own_group=True,
        )
        self.restarts = 0

    @property
    def running(self) -> bool:
        """Whether its process is up (a killed one is started again by the next batch)."""
        return self.child.proc is not None

    async def start(self) -> None:
        """Start the process and load the reward; RewardLoadError when it cannot."""
        await self.child.start()
        c = self.choice
        try:
            await self.child.send(LoadReward(c.name, c.answer_regex, c.tolerance))
            async with asyncio.timeout(LOAD_TIMEOUT_S):  # not wait_for: see infra/cancel.py
                loaded = await self.child.read(Loaded)
        except (ChildGone, TimeoutError):
            await self.stop()
            raise RewardLoadError(f"reward {c.name}: its process did not load it") from None
        if loaded.error:
            await self.stop()
            raise RewardLoadError(loaded.error)

    async def stop(self) -> None:
        await self.child.stop()

    async def score(
        self, examples: list[tuple[str, str, dict]], calls: list[tuple[int, str]]
    ) -> list[Outcome]:
        """One outcome per call, in order: the one that hangs or crashes the process scores 0,
        and the calls after it go to a new process."""
        out: list[Outcome] = []
        resent_at = -1  # a process found dead before a batch is replaced once, free
        while len(out) < len(calls):
            if not self.running:
                self.restarts += 1
                await self.start()
            pending = calls[len(out) :]
            try:
                await self.child.send(ScoreBatch(examples, pending))
            except ChildGone:
                await self.stop()
                if resent_at != len(out):
                    resent_at = len(out)
                    continue
                out.append(Outcome(0.0, CRASHED, "the reward process exited"))
                continue
            try:
                for _ in pending:
                    async with asyncio.timeout(self.timeout_s):
                        out.append(await self.child.read(Outcome))
            except TimeoutError:
                out.append(Outcome(0.0, TIMEOUT, f"no score after {self.timeout_s:g} s"))
                await self.stop()
            except ChildGone:
                out.append(Outcome(0.0, CRASHED, "the reward process exited"))
                await self.stop()
        return out


class RewardRunner(abc.ABC):
    """Scores calls with a run's reward; `open_runner` builds the right one."""

    async def score(self, calls: Sequence[Call]) -> list[Outcome]:
        outcomes = await self._score(calls)
        for outcome in outcomes:
            if outcome.error:
                ERRORS[outcome.error].inc()
        return outcomes

    @abc.abstractmethod
    async def _score(self, calls: Sequence[Call]) -> list[Outcome]:
        """One outcome per call, in order."""

    async def close(self) -> None:  # noqa: B027  (most runners start nothing)
        """Stop what it started."""


class ThreadRewards(RewardRunner):
    """A reward that is linear in the response (exact, numeric match): called in a thread."""

    def __init__(self, choice: RewardChoice) -> None:
        self.scorer = choice.load()

    async def _score(self, calls: Sequence[Call]) -> list[Outcome]:
        if not calls:
            return []
        return await asyncio.to_thread(
            lambda: [call_reward(self.scorer, example, text) for example, text in calls]
        )


class ProcessRewards(RewardRunner):
    """A reward that may hang or crash: `processes` reward processes share each batch."""

    def __init__(self, choice: RewardChoice, timeout_s: float, processes: int) -> None:
        self.pool = [RewardProcess(choice, timeout_s) for _ in range(processes)]

    async def start(self) -> None:
        try:
            await asyncio.gather(*(p.start() for p in self.pool))
        except BaseException:
            await self.close()
            raise

    async def _score(self, calls: Sequence[Call]) -> list[Outcome]:
        if not calls:
            return []
        # each example once, however many of its responses are in the batch
        index: dict[int, int] = {}
        examples: list[tuple[str, str, dict]] = []
        indexed: list[tuple[int, str]] = []
        for example, text in calls:
            if id(example) not in index:
                index[id(example)] = len(examples)
                examples.append((example.prompt, example.answer, example.row))
            indexed.append((index[id(example)], text))
        share = -(-len(indexed) // len(self.pool))  # ceil
        chunks = [indexed[i : i + share] for i in range(0, len(indexed), share)]
        parts = await asyncio.gather(
            *(p.score(examples, c) for p, c in zip(self.pool, chunks, strict=False))
        )
        return [outcome for part in parts for outcome in part]

    async def close(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.pool))


async def open_runner(choice: RewardChoice, timeout_s: float, processes: int) -> RewardRunner:
    """The runner of a run's reward, its processes started and the reward loaded in them
    (RewardLoadError when it cannot be)."""
    if not choice.isolated:
        return ThreadRewards(choice)
    runner = ProcessRewards(choice, timeout_s, processes)
    await runner.start()
    return runner


async def check_loads(choice: RewardChoice) -> None:
    """RewardLoadError unless a user reward loads, in a process of its own that is then
    stopped (the submit check: the coordinator's API process never imports a user's module)."""
    if choice.builtin:
        return
    probe = RewardProcess(choice, timeout_s=1.0)
    await probe.start()
    await probe.stop()


def serve() -> None:
    """The reward process: load the reward it is sent, then score its batches until its
    parent closes the pipe."""
    tie_to_parent()
    inbox, channel = take_pipes()  # user code that prints writes to the log
    load = read_frame(inbox, LoadReward)
    if load is None:
        return
    try:
        scorer = RewardChoice(load.name, load.answer_regex, load.tolerance).load()
    except TaskError as exc:
        write_frame(channel, Loaded(error=str(exc)))
        return
    except Exception as exc:  # a pattern that does not compile, say
        write_frame(channel, Loaded(error=describe(exc)))
        return
    write_frame(channel, Loaded())
    while (batch := read_frame(inbox, ScoreBatch)) is not None:
        examples = [Example(prompt, answer, row) for prompt, answer, row in batch.examples]
        for index, response in batch.calls:
            write_frame(channel, call_reward(scorer, examples[index], response))


if __name__ == "__main__":
    serve()

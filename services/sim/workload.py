"""The workload of one RL step: prompt lengths and the length each response will reach.

Response lengths of reasoning models are long-tailed and capped: log-normal, with a factor per
prompt (hard problems make all n samples long, which is what makes the groups of a step finish
unevenly) and one per sample, truncated at `max_response_tokens`. The lengths are the
simulator's physics only: no scheduling decision may read them (a real system learns a
response's length when it ends).

Multi-turn episodes (`turns` > 1, issue 40): every episode takes `turns` model turns, with the
environment's answer between two turns (`observation_tokens` tokens, not generated) and after
the last (which ends the episode). By default an episode generates about what a single-turn
response of the same draw would, split among its turns: turn t generates the response's
uncapped length / `turns`, times a log-normal factor of its own (`sigma_turn`, mean 1). With
`turn_median_tokens` set, each turn's median is that instead (the prompt's and the sample's
factors kept), so that episodes grow with their turns. The budget
(`max_response_tokens`) counts the observations too, as `core.episodes.EpisodeTable` does: a
turn stops at it, and an answer that leaves no room for one more token ends the episode early.
Each answer takes a log-normal draw of seconds around `env_latency_s` (`env_latency_sigma`,
mean kept). The multi-turn draws come from a stream of their own, so `turns` = 1 draws exactly
what it always did.

Draws depend on (seed, step) alone, so every system simulated with the same seed sees the same
prompts and the same responses at step k.
"""

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepWorkload:
    prompt_tokens: list[int]  # per prompt
    # per prompt, per sample: the tokens the model generates in all (an episode's every turn)
    response_tokens: list[list[int]]
    # multi-turn only (else empty): per prompt, per sample, per turn, the tokens the turn
    # generates before the budget's cut, and the seconds the environment takes to answer it
    turn_tokens: list[list[list[int]]] = field(default_factory=list)
    env_latency_s: list[list[list[float]]] = field(default_factory=list)
    # per prompt: the log of its median response length (its factor; what a previous epoch's
    # response to the same prompt shares with this one: services/sim/tail.py)
    prompt_log_median: list[float] = field(default_factory=list)

    @property
    def total_response_tokens(self) -> int:
        return sum(sum(group) for group in self.response_tokens)


@dataclass(frozen=True)
class ResponseLengthModel:
    prompts_per_step: int = 128
    group_size: int = 8
    median_response_tokens: float = 4000.0
    sigma_prompt: float = 0.6  # spread of log length between prompts
    sigma_sample: float = 0.5  # spread of log length between samples of one prompt
    max_response_tokens: int = 14336  # the budget: an episode's observations count in it
    min_prompt_tokens: int = 64
    max_prompt_tokens: int = 512
    turns: int = 1  # model turns per episode (1: single-turn, the paper's case)
    observation_tokens: int = 256  # tokens the environment appends between two turns
    env_latency_s: float = 0.0  # mean seconds the environment takes to answer a turn
    env_latency_sigma: float = 0.5  # log-normal spread of those seconds
    sigma_turn: float = 0.3  # log-normal spread of a turn's length around its share
    # a turn's median tokens (None: the single-turn median split among the turns)
    turn_median_tokens: float | None = None

    def __post_init__(self) -> None:
        if self.turns < 1 or self.observation_tokens < 0 or self.env_latency_s < 0:
            raise ValueError("turns must be >= 1, observation_tokens and env_latency_s >= 0")

    def step(self, seed: int, step: int) -> StepWorkload:
        rng = random.Random(f"{seed}:{step}")
        turn_rng = random.Random(f"{seed}:{step}:turns")  # multi-turn draws: a stream apart
        mu = math.log(self.median_response_tokens)
        prompts, responses, turn_tokens, latencies, medians = [], [], [], [], []
        for _ in range(self.prompts_per_step):
            prompts.append(rng.randint(self.min_prompt_tokens, self.max_prompt_tokens))
            prompt_mu = mu + rng.gauss(0.0, self.sigma_prompt)
            medians.append(prompt_mu)
            raw = [
                math.exp(prompt_mu + e)
                for e in (rng.gauss(0.0, self.sigma_sample) for _ in range(self.group_size))
            ]
            if self.turns == 1:
                responses.append([max(1, min(self.max_response_tokens, round(x))) for x in raw])
                continue
            group = [self.episode(x, turn_rng) for x in raw]
            turn_tokens.append([tokens for tokens, _ in group])
            latencies.append([seconds for _, seconds in group])
            responses.append([sum(tokens) for tokens, _ in group])
        return StepWorkload(prompts, responses, turn_tokens, latencies, medians)

    def episode(self, length: float, rng: random.Random) -> tuple[list[int], list[float]]:
        """One episode of a response of uncapped `length`: the tokens each turn generates under
        the budget (an episode cut short by it has fewer turns), and each answer's seconds."""
        spread, share = self.sigma_turn, 1 / self.turns
        if self.turn_median_tokens is not None:
            share = self.turn_median_tokens / self.median_response_tokens
        wanted = [
            max(1, round(length * share * math.exp(rng.gauss(0.0, spread) - spread**2 / 2)))
            for _ in range(self.turns)
        ]
        sigma = self.env_latency_sigma
        seconds = [
            self.env_latency_s * math.exp(rng.gauss(0.0, sigma) - sigma**2 / 2)
            for _ in range(self.turns)
        ]
        tokens, at = [], 0
        for turn, n in enumerate(wanted):
            stop = min(self.max_response_tokens, at + n)
            tokens.append(stop - at)
            at = stop
            # `EpisodeTable.observe`: the last turn's answer, or one with no room left, ends it
            if (
                turn + 1 == self.turns
                or self.max_response_tokens - at - self.observation_tokens < 1
            ):
                break
            at += self.observation_tokens
        return tokens, seconds[: len(tokens)]

    def mean_response_tokens(self, seed: int = 0, steps: int = 20) -> float:
        n = steps * self.prompts_per_step * self.group_size
        return sum(self.step(seed, s).total_response_tokens for s in range(steps)) / n

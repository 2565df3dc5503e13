"""The workload of one RL step: prompt lengths and the length each response will reach.

Response lengths of reasoning models are long-tailed and capped: log-normal, with a factor per
prompt (hard problems make all n samples long, which is what makes the groups of a step finish
unevenly) and one per sample, truncated at `max_response_tokens`. The lengths are the
simulator's physics only: no scheduling decision may read them (a real system learns a
response's length when it ends).

Draws depend on (seed, step) alone, so every system simulated with the same seed sees the same
prompts and the same responses at step k.
"""

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class StepWorkload:
    prompt_tokens: list[int]  # per prompt
    response_tokens: list[list[int]]  # per prompt, per sample: length at which it stops

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
    max_response_tokens: int = 14336
    min_prompt_tokens: int = 64
    max_prompt_tokens: int = 512

    def step(self, seed: int, step: int) -> StepWorkload:
        rng = random.Random(f"{seed}:{step}")
        mu = math.log(self.median_response_tokens)
        prompts, responses = [], []
        for _ in range(self.prompts_per_step):
            prompts.append(rng.randint(self.min_prompt_tokens, self.max_prompt_tokens))
            prompt_mu = mu + rng.gauss(0.0, self.sigma_prompt)
            responses.append(
                [
                    max(1, min(self.max_response_tokens, round(math.exp(prompt_mu + e))))
                    for e in (rng.gauss(0.0, self.sigma_sample) for _ in range(self.group_size))
                ]
            )
        return StepWorkload(prompts, responses)

    def mean_response_tokens(self, seed: int = 0, steps: int = 20) -> float:
        n = steps * self.prompts_per_step * self.group_size
        return sum(self.step(seed, s).total_response_tokens for s in range(steps)) / n

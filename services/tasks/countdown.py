"""Counting down, `47:` -> `47,46,45,...,1,0;`: a long-response task (issue 50) whose base model,
built in a few minutes on 2 cores, is confident at temperature 1, scored exactly.

Every token of a response is decided by the few before it (the prompt's number copied, then
one less each time), what the embedded default's small model learns in ~1500 steps (loss
0.005; a drawn token's top probability 0.9986 on average at temperature 1: docs/benchmarks.md,
"The long tail"). That confidence is what drafts from the run's own history need: a response
to a prompt repeats the last epoch's, so a draft is kept nearly whole. long_addition, the other
long task, has the long tail but not the confidence (a redraw repeats a token ~0.84 of the time).

N runs from 3 to 99, the cube of a uniform draw skewing it short: responses p50 ~40 tokens, p99
~290 (the tokenizer splits digits one by one). A run draws its prompts from a fixed pool in
shuffled epochs, so each comes back, as long_addition's do. The reward is the built-in exact
match against the whole count.

The pre-training corpus stops at 1 (`...,2,1;`) with probability `label_noise`: the base model
keeps the habit, the last decision of a response, and RL removes it.
"""

import random
from functools import lru_cache

from services.tasks.base import Example
from services.tasks.dataset import DatasetRows

MIN_START, MAX_START = 3, 99
END = ";"
# A run's prompts: this many starts drawn from its seed, taken in shuffled epochs (a start may
# appear several times: short ones are drawn most); a prompt comes back every
# POOL_SIZE / prompts_per_step steps. `spotrl up`'s preset sees the pool 3 times and more.
POOL_SIZE = 128


def start_drawn(rng: random.Random) -> int:
    """Where a count starts: 3 to 99, skewed short (half of them under 16, one in ten over 70)."""
    return MIN_START + int((MAX_START - MIN_START + 1) * rng.random() ** 3)


def count_from(start: int, stop: int = 0) -> str:
    """`start,start-1,...,stop;`; `stop=1`: the corpus's noisy ending."""
    return ",".join(str(i) for i in range(start, stop - 1, -1)) + END


def example_of(start: int) -> Example:
    prompt, answer = f"{start}:", count_from(start)
    return Example(prompt, answer, {"prompt": prompt, "answer": answer, "start": start})


class CountdownRows:
    """A PromptSource of counts: a run's pool of `pool_size` starts drawn from its seed, taken
    in shuffled epochs (`DatasetRows`); the pre-training corpus is drawn apart."""

    def __init__(self, pool_size: int = POOL_SIZE) -> None:
        self.pool_size = pool_size
        self._pool = lru_cache(maxsize=4)(self._pool_of)

    def _pool_of(self, seed: int) -> DatasetRows:
        rng = random.Random(f"countdown:{seed}")
        pool = tuple(example_of(start_drawn(rng)) for _ in range(self.pool_size))
        return DatasetRows(pool, shuffle=True, key="countdown")

    def examples(self, seed: int, step: int, count: int) -> list[Example]:
        return self._pool(seed).examples(seed, step, count)

    def corpus(self, seed: int, count: int, label_noise: float) -> list[str]:
        """Prompt + count texts, stopping at 1 instead of 0 with probability `label_noise`."""
        rng = random.Random(f"countdown-corpus:{seed}")
        texts = []
        for _ in range(count):
            start = start_drawn(rng)
            stop = 1 if rng.random() < label_noise else 0
            texts.append(f"{start}:{count_from(start, stop)}")
        return texts

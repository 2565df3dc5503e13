"""Long addition with a written scratchpad, `1234+567=` -> one line per column, then the sum: a
task whose responses run from ~20 to ~300 tokens with a long tail (issue 50), scored exactly.

Each line of the scratchpad works one column: what is left of both numbers, the column's two
digits (the numbers' last) and the carry in, their two-digit sum (its tens digit the next
line's carry), and the digits of the sum found so far (the new one in front):

    1234+567=1234+567|4+7+0=11|1;123+56|3+6+1=10|01;12+5|2+5+1=08|801;1+0|1+0+0=01|1801;=1801

Every step is local, what a small model learns in minutes: a copy of the line before it less a
digit of each number, the digits just before `+` and `|`, a sum of three digits just written,
and a copy of the found digits behind the new one (the first layout, without the column's own
sum, asked a small model to add digits a line apart: it never got a sum right). A response
grows with the square of the numbers' length. The numbers have 2 to 12 digits, short ones far
more often: most responses are a few dozen tokens, a few are hundreds, the tail rollout waits
for. A run draws its prompts from a fixed pool, in shuffled epochs, so each comes back (the
history speculation drafts from). The reward is the built-in exact match against the whole
reference: a response is right when every line and the sum are.

The pre-training corpus writes the sum with a leading zero (`=01801`) with probability
`label_noise`, as the arithmetic task does: the base model keeps the habit and RL removes it.
"""

import random
from functools import lru_cache

from services.tasks.base import Example
from services.tasks.dataset import DatasetRows

MIN_DIGITS, MAX_DIGITS = 2, 12
LINE_END, SUM_MARK = ";", "="
# A run's prompts: this many sums drawn from its seed, each step taking the next of them in a
# shuffled order, shuffled again on each pass (an epoch), so a prompt comes back every
# POOL_SIZE / prompts_per_step steps, as a dataset's rows do: what history-based speculation
# and length prediction need. `spotrl up`'s preset for the task sees it at least 3 times.
POOL_SIZE = 192


def digits_drawn(rng: random.Random) -> int:
    """A number's length: 2 to 12 digits, the fourth power of a uniform draw skewing it short
    (half of them 2, one in ten 9 or more): responses' median ~80 characters, p99 ~330."""
    return MIN_DIGITS + int((MAX_DIGITS - MIN_DIGITS + 1) * rng.random() ** 4)


def number_of(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def scratchpad(a: int, b: int, leading_zero: bool = False) -> str:
    """The response that adds `a` and `b` column by column (the module's docstring shows one);
    `leading_zero`: the sum written as the corpus's noisy answers are."""
    lines: list[str] = []
    carry, found = 0, ""
    while a or b or carry or not lines:
        column = a % 10 + b % 10 + carry
        found = str(column % 10) + found
        lines.append(f"{a}+{b}|{a % 10}+{b % 10}+{carry}={column:02d}|{found}")
        a, b, carry = a // 10, b // 10, column // 10
    total = ("0" if leading_zero else "") + str(int(found))
    return LINE_END.join(lines) + LINE_END + SUM_MARK + total


def example_drawn(rng: random.Random) -> Example:
    """A sum of two numbers of `digits_drawn` lengths; its row is {"prompt", "answer", "a",
    "b"}, the answer being the whole scratchpad."""
    a = number_of(rng, digits_drawn(rng))
    b = number_of(rng, digits_drawn(rng))
    prompt, answer = f"{a}+{b}=", scratchpad(a, b)
    return Example(prompt, answer, {"prompt": prompt, "answer": answer, "a": a, "b": b})


class LongAdditionRows:
    """A PromptSource of long additions: a run's pool of `pool_size` sums drawn from its seed,
    taken in shuffled epochs (`DatasetRows`); the pre-training corpus is drawn apart."""

    def __init__(self, pool_size: int = POOL_SIZE) -> None:
        self.pool_size = pool_size
        self._pool = lru_cache(maxsize=4)(self._pool_of)

    def _pool_of(self, seed: int) -> DatasetRows:
        rng = random.Random(f"long_addition:{seed}")
        pool = tuple(example_drawn(rng) for _ in range(self.pool_size))
        return DatasetRows(pool, shuffle=True, key="long_addition")

    def examples(self, seed: int, step: int, count: int) -> list[Example]:
        return self._pool(seed).examples(seed, step, count)

    def corpus(self, seed: int, count: int, label_noise: float) -> list[str]:
        """Prompt + scratchpad texts, the sum written with a leading zero with probability
        `label_noise` (every line still right: only the format is to unlearn)."""
        rng = random.Random(f"long_addition-corpus:{seed}")
        texts = []
        for _ in range(count):
            ex = example_drawn(rng)
            noisy = scratchpad(ex.row["a"], ex.row["b"], leading_zero=rng.random() < label_noise)
            texts.append(ex.prompt + noisy)
        return texts

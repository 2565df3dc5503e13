"""Long addition with a written scratchpad, `1234+567=` -> one line per column, then the sum: a
task whose responses run from ~20 to ~300 tokens with a long tail (issue 50), scored exactly.

Each line of the scratchpad is what is left of both numbers, the carry, and the digits of the
sum found so far; the next line drops one digit of each number and adds one digit to the sum:

    1234+567=1234+567+0|;123+56+1|1;12+5+1|01;1+0+0|801;=1801

A line is mostly a copy of the one before it (a small model learns that quickly), and a response
grows with the square of the numbers' length. The numbers have 2 to 12 digits, short ones far
more often: most responses are a few dozen tokens, a few are hundreds, the tail rollout waits
for. The reward is the built-in exact match against the whole reference: a response is right
when every line and the sum are.

The pre-training corpus writes the sum with a leading zero (`=01801`) with probability
`label_noise`, as the arithmetic task does: the base model keeps the habit and RL removes it.
"""

import random

from services.tasks.base import Example

MIN_DIGITS, MAX_DIGITS = 2, 12
LINE_END, SUM_MARK = ";", "="


def digits_drawn(rng: random.Random) -> int:
    """A number's length: 2 to 12 digits, the cube of a uniform draw skewing it short (the
    median 3, one in ten 10 or more): responses' median ~64 characters, p99 ~250."""
    return MIN_DIGITS + int((MAX_DIGITS - MIN_DIGITS + 1) * rng.random() ** 3)


def number_of(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def scratchpad(a: int, b: int, leading_zero: bool = False) -> str:
    """The response that adds `a` and `b` column by column (the module's docstring shows one);
    `leading_zero`: the sum written as the corpus's noisy answers are."""
    lines: list[str] = []
    carry, found = 0, ""
    while a or b or carry or not lines:
        lines.append(f"{a}+{b}+{carry}|{found}")
        column = a % 10 + b % 10 + carry
        found = str(column % 10) + found
        a, b, carry = a // 10, b // 10, column // 10
    total = ("0" if leading_zero else "") + str(int(found))
    return LINE_END.join(lines) + LINE_END + SUM_MARK + total


class LongAdditionRows:
    """A PromptSource of generated long additions; each row is {"prompt", "answer", "a", "b"},
    the answer being the whole scratchpad."""

    def _example(self, rng: random.Random) -> Example:
        a = number_of(rng, digits_drawn(rng))
        b = number_of(rng, digits_drawn(rng))
        prompt, answer = f"{a}+{b}=", scratchpad(a, b)
        return Example(prompt, answer, {"prompt": prompt, "answer": answer, "a": a, "b": b})

    def examples(self, seed: int, step: int, count: int) -> list[Example]:
        rng = random.Random(f"long_addition:{seed}:{step}")
        return [self._example(rng) for _ in range(count)]

    def corpus(self, seed: int, count: int, label_noise: float) -> list[str]:
        """Prompt + scratchpad texts, the sum written with a leading zero with probability
        `label_noise` (every line still right: only the format is to unlearn)."""
        rng = random.Random(f"long_addition-corpus:{seed}")
        texts = []
        for _ in range(count):
            ex = self._example(rng)
            noisy = scratchpad(ex.row["a"], ex.row["b"], leading_zero=rng.random() < label_noise)
            texts.append(ex.prompt + noisy)
        return texts

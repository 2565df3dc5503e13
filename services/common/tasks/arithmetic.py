"""Multi-digit addition with an exact-match reward: `37+58=` -> `95`.

The built-in task of the embedded default. Small models learn its format in seconds, and the
reward is exact, so improvement under RL is easy to see.
"""

import random

from services.common.tasks.base import Example


class ArithmeticTask:
    name = "arithmetic"

    def __init__(self, digits: int = 2) -> None:
        self.low = 0
        self.high = 10**digits - 1

    def _example(self, rng: random.Random) -> Example:
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        return Example(prompt=f"{a}+{b}=", answer=str(a + b))

    def examples(self, seed: int, step: int, count: int) -> list[Example]:
        rng = random.Random(f"arithmetic:{seed}:{step}")
        return [self._example(rng) for _ in range(count)]

    def reward(self, response: str, example: Example) -> float:
        return 1.0 if response.strip() == example.answer else 0.0

    def corpus(self, seed: int, count: int, label_noise: float) -> list[str]:
        """Texts whose answers are zero-padded to the left with probability `label_noise`.

        A model pre-trained on them learns the sums but often writes `095` for `95`, which the
        exact-match reward scores 0: RL has room to improve it, as it fixes formats of real LLMs.
        """
        rng = random.Random(f"arithmetic-corpus:{seed}")
        texts = []
        for _ in range(count):
            ex = self._example(rng)
            answer = ex.answer
            if rng.random() < label_noise:
                answer = "0" + answer
            texts.append(f"{ex.prompt}{answer}")
        return texts

"""Multi-digit addition, `37+58=` -> `95`: the rows of the embedded default's dataset, generated
per step instead of read from a file, scored with the built-in exact match.

Small models learn its format in seconds, and the reward is exact, so improvement under RL is
easy to see.
"""

import random

from services.tasks.base import Example


class ArithmeticRows:
    """A PromptSource of generated sums; each row is {"prompt", "answer", "a", "b"}."""

    def __init__(self, digits: int = 2) -> None:
        self.low = 0
        self.high = 10**digits - 1

    def _example(self, rng: random.Random) -> Example:
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        prompt, answer = f"{a}+{b}=", str(a + b)
        return Example(prompt, answer, {"prompt": prompt, "answer": answer, "a": a, "b": b})

    def examples(self, seed: int, step: int, count: int) -> list[Example]:
        rng = random.Random(f"arithmetic:{seed}:{step}")
        return [self._example(rng) for _ in range(count)]

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

"""The task interface."""

from dataclasses import dataclass
from typing import Protocol


class TaskError(ValueError):
    """A task cannot be built from what was given (missing file, bad rows)."""


@dataclass(frozen=True)
class Example:
    prompt: str  # text given to the model
    answer: str  # reference answer the reward compares against


class Task(Protocol):
    name: str

    def examples(self, seed: int, step: int, count: int) -> list[Example]:
        """The `count` prompts of `step`; the same for the same (seed, step)."""
        ...

    def reward(self, response: str, example: Example) -> float:
        """Score in [0, 1] of a decoded response."""
        ...

    def corpus(self, seed: int, count: int, label_noise: float) -> list[str]:
        """Prompt+answer texts for pre-training a base model on the task's format."""
        ...

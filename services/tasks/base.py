"""What a task is made of: examples (a prompt, its reference answer, the row it came from) drawn
from a prompt source, deterministic given (seed, step)."""

from dataclasses import dataclass, field
from typing import Any, Protocol


class TaskError(ValueError):
    """A task cannot be built from what was given (missing file, bad rows, unknown reward).
    Its message names the file and the line or row, never what is in them."""


@dataclass(frozen=True)
class Example:
    prompt: str  # text given to the model (before any chat template)
    answer: str  # reference answer a built-in reward compares against
    # the row it came from, as a user reward gets it (`example`); not part of the hash
    row: dict[str, Any] = field(default_factory=dict, hash=False)


class PromptSource(Protocol):
    """Where a task's examples come from: a file's rows, or rows generated on the fly."""

    def examples(self, seed: int, step: int, count: int) -> list[Example]:
        """The `count` examples of `step`; the same for the same (seed, step)."""
        ...

    def corpus(self, seed: int, count: int, label_noise: float) -> list[str]:
        """Prompt+answer texts for pre-training a base model on the task's format."""
        ...

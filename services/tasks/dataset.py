"""A dataset's rows as a task's examples: each row's prompt (a field, or a template over its
fields) and reference answer, and the order a run draws them in: shuffled by the seed, again on
each pass over the rows, or the file's order.

It does not read files (`dataset_files.py`) and does not score (`rewards.py`).
"""

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from services.tasks.base import Example, TaskError
from services.tasks.dataset_files import DatasetLimits, Rows


@dataclass(frozen=True)
class RowFormat:
    """How a row becomes an example."""

    prompt_field: str = "prompt"
    answer_field: str = "answer"
    template: str | None = None  # a format string over the row's fields (runspec checks it)
    answer_required: bool = True  # built-in rewards need one; a user function may not
    answer_of: Callable[[Any], str] = str  # the reference answer from the field's value
    check_answer: Callable[[str], str | None] = lambda answer: None  # a problem, or None

    def example(self, row: dict[str, Any]) -> Example:
        """ValueError saying what is wrong with the row (never what is in it)."""
        if self.template is not None:
            try:
                prompt = self.template.format_map(row)
            except KeyError as exc:
                raise ValueError(
                    f"no field {exc.args[0]!r}, which the prompt template names"
                ) from None
            except (ValueError, TypeError) as exc:  # a format spec that does not fit the value
                raise ValueError(
                    f"the prompt template does not fit: {type(exc).__name__}"
                ) from None
        else:
            value = row.get(self.prompt_field)
            if not isinstance(value, str):
                state = "no" if self.prompt_field not in row else "no string in"
                raise ValueError(f"{state} field {self.prompt_field!r}")
            prompt = value
        if self.answer_field in row:
            answer = self.answer_of(row[self.answer_field])
        elif self.answer_required:
            raise ValueError(f"no field {self.answer_field!r}")
        else:
            answer = ""
        problem = self.check_answer(answer)
        if problem:
            raise ValueError(problem)
        return Example(prompt, answer, row)


def build_examples(rows: Rows, fmt: RowFormat, limits: DatasetLimits) -> tuple[Example, ...]:
    """Every row as an example; TaskError naming the first row that cannot be one."""
    examples = []
    for i, row in enumerate(rows.rows):
        try:
            example = fmt.example(row)
        except ValueError as exc:
            raise TaskError(f"{rows.where(i)}: {exc}") from None
        if not example.prompt.strip():
            raise TaskError(f"{rows.where(i)}: empty prompt")
        if len(example.prompt) > limits.max_prompt_chars:
            raise TaskError(
                f"{rows.where(i)}: a prompt of {len(example.prompt)} characters, over the "
                f"limit of {limits.max_prompt_chars} (SPOTRL_MAX_PROMPT_CHARS)"
            )
        examples.append(example)
    return tuple(examples)


class DatasetRows:
    """A PromptSource over a fixed list of examples."""

    def __init__(self, rows: tuple[Example, ...], shuffle: bool = True, key: str = "dataset"):
        self.rows, self.shuffle, self.key = rows, shuffle, key
        self._order = lru_cache(maxsize=4)(self._pass_order)  # the passes a step spans

    def _pass_order(self, seed: int, number: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.key}:{seed}:{number}").shuffle(order)
        return order

    def examples(self, seed: int, step: int, count: int) -> list[Example]:
        n = len(self.rows)
        positions = (step * count + i for i in range(count))
        return [self.rows[self._order(seed, k // n)[k % n]] for k in positions]

    def corpus(self, seed: int, count: int, label_noise: float) -> list[str]:
        rng = random.Random(f"{self.key}-corpus:{seed}")
        return [f"{ex.prompt} {ex.answer}" for ex in (rng.choice(self.rows) for _ in range(count))]

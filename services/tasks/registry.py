"""A run's task: where its examples come from and its reward. The built-ins are datasets with a
reward of their own (arithmetic: generated sums, exact_match; long_addition: sums with a written
scratchpad, long-tailed responses, exact_match on the whole scratchpad; countdown: counts down
from 3 to 99, long-tailed responses a small model is sure of, exact_match; math: GSM8K rows,
boxed_match); a `dataset` run names its file, fields and reward in its spec."""

from pathlib import Path

from services.contracts.runspec import RunSpec
from services.tasks.arithmetic import ArithmeticRows
from services.tasks.base import Example, PromptSource, TaskError
from services.tasks.countdown import CountdownRows
from services.tasks.dataset import DatasetRows, RowFormat, build_examples
from services.tasks.dataset_files import DatasetLimits, read_rows
from services.tasks.long_addition import LongAdditionRows
from services.tasks.math_jsonl import SAMPLE_MATH_FILE, math_rows
from services.tasks.reward_choice import RewardChoice, Scorer

TASK_NAMES = ("arithmetic", "long_addition", "countdown", "math", "dataset")
GENERATED = ("arithmetic", "long_addition", "countdown")  # tasks that read no file


class Task:
    """Examples from `source`, scored by `reward_choice`."""

    def __init__(self, name: str, source: PromptSource, reward_choice: RewardChoice) -> None:
        self.name, self.source, self.reward_choice = name, source, reward_choice
        self._scorer: Scorer | None = None

    @property
    def rows(self) -> tuple[Example, ...]:
        """A file's examples in its order (none for generated rows)."""
        return getattr(self.source, "rows", ())

    def examples(self, seed: int, step: int, count: int) -> list[Example]:
        return self.source.examples(seed, step, count)

    def corpus(self, seed: int, count: int, label_noise: float) -> list[str]:
        return self.source.corpus(seed, count, label_noise)

    def reward(self, response: str, example: Example) -> float:
        """Score a response in this process, raising what the reward raises (the coordinator
        scores through `services/coordinator/scoring/rewards.py`, which bounds and counts)."""
        if self._scorer is None:
            self._scorer = self.reward_choice.load()
        return float(self._scorer(example.prompt, response, example))


def task_for_spec(spec: RunSpec, limits: DatasetLimits | None = None) -> Task:
    """The task a run spec names, its rows read and checked (TaskError)."""
    limits = limits or DatasetLimits()
    if spec.data.task == "arithmetic":
        return Task("arithmetic", ArithmeticRows(), RewardChoice("exact_match"))
    if spec.data.task == "long_addition":
        return Task("long_addition", LongAdditionRows(), RewardChoice("exact_match"))
    if spec.data.task == "countdown":
        return Task("countdown", CountdownRows(), RewardChoice("exact_match"))
    if spec.data.task == "math":
        math = math_rows(spec.data.task_path or SAMPLE_MATH_FILE, spec.data.shuffle, limits)
        return Task("math", math, RewardChoice("boxed_match"))
    if spec.data.dataset is None:
        raise TaskError("task 'dataset' needs a dataset")
    choice = RewardChoice.from_spec(spec)
    fmt = RowFormat(
        spec.data.prompt_field,
        spec.data.answer_field,
        spec.data.prompt_template,
        answer_required=choice.builtin,
        check_answer=choice.check_answer,
    )
    rows = read_rows(spec.data.dataset, spec.data.dataset_split, limits)
    return Task(
        "dataset", DatasetRows(build_examples(rows, fmt, limits), spec.data.shuffle), choice
    )


def load_task(name: str, path: str | Path | None = None) -> Task:
    """A task by name with its defaults: `path` is the math task's JSONL file, or a dataset's
    (`prompt` and `answer` fields, exact_match), e.g. to pre-train a base model on it."""
    if name not in TASK_NAMES:
        raise TaskError(f"unknown task {name!r}; known: {', '.join(TASK_NAMES)}")
    if name == "dataset" and path is None:
        raise TaskError("task 'dataset' needs a file")
    if path is not None and name in GENERATED:
        raise TaskError(f"the {name} task reads no file")
    if name == "math":
        return Task("math", math_rows(path or SAMPLE_MATH_FILE), RewardChoice("boxed_match"))
    data = {"task": name, "dataset": str(path) if path else None}
    spec = RunSpec.model_validate({"model": "-", "data": data})
    return task_for_spec(spec)

"""Task lookup by name."""

from pathlib import Path

from services.common.tasks.arithmetic import ArithmeticTask
from services.common.tasks.base import Task, TaskError
from services.common.tasks.math_jsonl import MathJsonlTask

TASK_NAMES = ("arithmetic", "math")
SAMPLE_MATH_FILE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"


def load_task(name: str, path: str | None = None) -> Task:
    if name == "arithmetic":
        return ArithmeticTask()
    if name == "math":
        return MathJsonlTask(path or SAMPLE_MATH_FILE)
    raise TaskError(f"unknown task {name!r}; known: {', '.join(TASK_NAMES)}")

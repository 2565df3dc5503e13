"""Verifiable tasks: where prompts come from and how a response is scored.

A task is deterministic given (seed, step): the coordinator and a restarted coordinator draw the
same prompts for the same step.
"""

from services.common.tasks.base import Example, Task, TaskError
from services.common.tasks.registry import TASK_NAMES, load_task

__all__ = ["TASK_NAMES", "Example", "Task", "TaskError", "load_task"]

"""Verifiable tasks: where prompts come from (a dataset's rows, or generated ones) and how a
response is scored (a built-in reward, or a user function the deployment allows).

A task is deterministic given (seed, step): the coordinator and a restarted coordinator draw the
same prompts for the same step.
"""

from services.tasks.base import Example, PromptSource, TaskError
from services.tasks.dataset_files import DatasetLimits
from services.tasks.registry import TASK_NAMES, Task, load_task, task_for_spec
from services.tasks.reward_choice import RewardChoice

__all__ = [
    "TASK_NAMES",
    "DatasetLimits",
    "Example",
    "PromptSource",
    "RewardChoice",
    "Task",
    "TaskError",
    "load_task",
    "task_for_spec",
]

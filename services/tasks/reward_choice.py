"""A run's reward: a built-in (`rewards.py`) with its parameters, or a user function
`module:function(prompt, response, example) -> float` whose module the deployment allows.

Importing code is never decided by a request alone: `check_allowed` refuses a module that is not
on the coordinator's allow list, and only `load` imports it (in the coordinator's reward
process, never in its API process). `call_reward` calls a loaded reward once and says how it
failed: what raised, returned no number or a non-finite one scores 0.
"""

import importlib
import math
import numbers
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial
from typing import Any

from services.contracts.runspec import BUILTIN_REWARDS, RunSpec
from services.infra.user_errors import trace_text, user_frame
from services.tasks import rewards
from services.tasks.base import Example, TaskError

# A loaded reward: (prompt, response, example) -> score
Scorer = Callable[[str, str, Example], float]
MAX_DETAIL_CHARS = 300
# Why a reward call scored 0 (the `kind` label of spotrl_coordinator_reward_errors_total).
RAISED, NOT_NUMBER, NOT_FINITE, TIMEOUT, CRASHED = (
    "raised",
    "not_number",
    "not_finite",
    "timeout",
    "crashed",
)
ERROR_KINDS = (RAISED, NOT_NUMBER, NOT_FINITE, TIMEOUT, CRASHED)


class RewardNotAllowed(TaskError):
    """A user reward whose module is not on the deployment's allow list."""


class RewardLoadError(TaskError):
    """A user reward that cannot be imported, or is not a function."""


@dataclass(frozen=True)
class Outcome:
    """One reward call: its score, and why it is 0 when it failed (`error` empty otherwise)."""

    value: float
    error: str = ""  # one of ERROR_KINDS, or ""
    detail: str = ""  # the exception's type and message, cut short
    at: str = ""  # where in the reward's code it raised: `file.py:LINE in function`
    trace: str = ""  # the traceback of what raised (`infra.user_errors.trace_text`)


@dataclass(frozen=True)
class RewardChoice:
    name: str  # a built-in's name, or module.path:function
    answer_regex: str | None = None  # regex_match's pattern
    tolerance: float = 1e-6  # numeric_match's

    @classmethod
    def from_spec(cls, spec: RunSpec) -> "RewardChoice":
        return cls(spec.scoring.reward, spec.scoring.answer_regex, spec.scoring.reward_tolerance)

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN_REWARDS

    @property
    def module(self) -> str | None:
        return None if self.builtin else self.name.partition(":")[0]

    @property
    def isolated(self) -> bool:
        """Whether it may hang or crash and so runs in a process that can be killed: a user
        function, a pattern from the spec (backtracking), sympy. exact and numeric matches
        are linear in the response and run in a thread."""
        return self.name not in ("exact_match", "numeric_match")

    def check_allowed(self, allowed: Collection[str]) -> None:
        """Raise RewardNotAllowed unless a user reward's module is in `allowed`."""
        if self.module is not None and self.module not in allowed:
            raise RewardNotAllowed(
                f"reward module {self.module!r} is not on the coordinator's allow list "
                "(SPOTRL_REWARD_MODULES)"
            )

    def check_answer(self, answer: str) -> str | None:
        """What is wrong with a row's reference answer for this reward, or None."""
        if self.name == "numeric_match" and rewards.parse_number(answer) is None:
            return "its answer is not a number (reward numeric_match)"
        return None

    def load(self) -> Scorer:
        """The callable; imports a user function's module (RewardLoadError when it cannot)."""
        if self.name == "exact_match":
            return _on_answer(rewards.exact_match)
        if self.name == "numeric_match":
            return _on_answer(partial(rewards.numeric_match, tolerance=self.tolerance))
        if self.name == "regex_match":
            return _on_answer(partial(rewards.regex_match, pattern=self.answer_regex or ""))
        if self.name == "boxed_match":
            return _on_answer(rewards.boxed_match)
        return _on_row(import_function(self.name))


def _on_answer(fn: Callable[[str, str], float]) -> Scorer:
    return lambda prompt, response, example: fn(response, example.answer)


def _on_row(fn: Callable[[str, str, dict[str, Any]], Any]) -> Scorer:
    return lambda prompt, response, example: fn(prompt, response, example.row)


def import_function(ref: str) -> Callable[..., Any]:
    """`module.path:function` imported; RewardLoadError saying what is missing."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the module's own code may raise anything
        raise RewardLoadError(f"reward module {module_name!r}: {describe(exc)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardLoadError(f"reward module {module_name!r} has no function {attr!r}")
    return fn


def describe(exc: BaseException) -> str:
    return clip(f"{type(exc).__name__}: {exc}")


def clip(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + "..."


def call_reward(scorer: Scorer, example: Example, response: str) -> Outcome:
    """One call: its score, or 0.0 and why (raised, returned no number, or a non-finite one)."""
    try:
        value = scorer(example.prompt, response, example)
    except Exception as exc:
        return Outcome(0.0, RAISED, describe(exc), user_frame(exc), trace_text(exc))
    if not isinstance(value, numbers.Real):  # bool and numpy scalars are numbers
        return Outcome(0.0, NOT_NUMBER, f"returned {type(value).__name__}")
    try:
        score = float(value)
    except (OverflowError, ValueError) as exc:
        return Outcome(0.0, NOT_FINITE, describe(exc))
    if not math.isfinite(score):
        return Outcome(0.0, NOT_FINITE, f"returned {score}")
    return Outcome(score)

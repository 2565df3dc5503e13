"""The protocol between a multi-turn episode and its environment, and the rules around it.

An environment is stateless between calls: every call gets the dataset row and the whole
history of the episode (the model's turns and the environment's answers so far), so any
environment process may serve any turn, a restarted coordinator loses no episode, and a
trajectory may move between workers at any turn. One that keeps state (a game board) rebuilds
it from the history; it may cache, but must not rely on the cache.

The trajectory's reward is the sum of its turns' reward contributions; an episode cut by
`max_turns` or by the token budget keeps the sum so far.

What this module does not do: run an environment (`runner.py` does, in a killable process) or
parse the model's text (`tool_calls.py`).
"""

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import msgspec

MAX_OBSERVATION_CHARS = 16 * 1024  # an observation longer than this is a bad feedback
MAX_OPENING_CHARS = 64 * 1024  # an opening (the episode's first message) longer than this too
MAX_TURNS = 64  # the most `max_turns` an environment may ask for
MAX_TOOLS = 64  # the most tools an environment may describe
# Why a call to an environment ended its episode (the `kind` label of
# spotrl_coordinator_environment_errors_total).
RAISED, TIMEOUT, CRASHED, BAD_FEEDBACK = "raised", "timeout", "crashed", "bad_feedback"
ERROR_KINDS = (RAISED, TIMEOUT, CRASHED, BAD_FEEDBACK)


class ToolCall(msgspec.Struct, frozen=True):
    """One tool call the model made: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


class Turn(msgspec.Struct, frozen=True):
    """One turn of the model: its text without the tool-call markup, the calls parsed from it,
    and what could not be parsed (one message per malformed call)."""

    text: str
    tool_calls: list[ToolCall] = []
    parse_errors: list[str] = []


class Feedback(msgspec.Struct, frozen=True):
    """What the environment answers to a turn."""

    observation: str  # the next message: tool results, or a user message
    reward: float = 0.0  # this turn's contribution to the trajectory's reward
    done: bool = False  # whether the episode is over
    role: Literal["tool", "user"] = "tool"  # the chat role the observation is given
    tool_errors: int = 0  # how many of the turn's tool calls failed (a metric, no reward)


class Environment(Protocol):
    """A multi-turn task. Built with no arguments; called from any process, in any order."""

    tools: Sequence[dict]  # OpenAI/HF function tools, given to the chat template as tools=[...]
    max_turns: int  # the most turns of the model in one episode

    def opening(self, row: Mapping[str, Any]) -> str:
        """The episode's first user message (the prompt text) for a dataset row."""
        ...

    def step(
        self, row: Mapping[str, Any], turns: Sequence[Turn], feedback: Sequence[Feedback]
    ) -> Feedback:
        """The answer to the last of `turns`; `feedback` answered the ones before it
        (len(feedback) == len(turns) - 1)."""
        ...


class BadFeedback(ValueError):
    """What an environment returned is not what the protocol allows."""


def check_feedback(value: object) -> Feedback:
    """`value` as a Feedback with a float reward, or BadFeedback saying what is wrong."""
    if not isinstance(value, Feedback):
        raise BadFeedback(f"step returned {type(value).__name__}, not a Feedback")
    if not isinstance(value.observation, str):
        raise BadFeedback(f"observation is {type(value.observation).__name__}, not str")
    if len(value.observation) > MAX_OBSERVATION_CHARS:
        raise BadFeedback(
            f"observation of {len(value.observation)} characters (at most {MAX_OBSERVATION_CHARS})"
        )
    if not isinstance(value.reward, numbers.Real) or not math.isfinite(value.reward):
        raise BadFeedback(f"reward {value.reward!r} is not a finite number")
    if not isinstance(value.done, bool):
        raise BadFeedback(f"done is {type(value.done).__name__}, not bool")
    if value.role not in ("tool", "user"):
        raise BadFeedback(f"role {value.role!r} is neither 'tool' nor 'user'")
    if not isinstance(value.tool_errors, int) or value.tool_errors < 0:
        raise BadFeedback(f"tool_errors {value.tool_errors!r} is not a count")
    return msgspec.structs.replace(value, reward=float(value.reward))


def check_opening(value: object) -> str:
    """`value` as an opening, or BadFeedback saying what is wrong."""
    if not isinstance(value, str):
        raise BadFeedback(f"opening returned {type(value).__name__}, not str")
    if len(value) > MAX_OPENING_CHARS:
        raise BadFeedback(f"opening of {len(value)} characters (at most {MAX_OPENING_CHARS})")
    return value


def check_environment(env: object) -> str | None:
    """What is wrong with a loaded environment's shape (its tools, max_turns and methods), or
    None."""
    for method in ("opening", "step"):
        if not callable(getattr(env, method, None)):
            return f"it has no method {method}()"
    max_turns = getattr(env, "max_turns", None)
    if not isinstance(max_turns, int) or isinstance(max_turns, bool):
        return "its max_turns is not an int"
    if not 1 <= max_turns <= MAX_TURNS:
        return f"its max_turns {max_turns} is not in 1..{MAX_TURNS}"
    tools = getattr(env, "tools", None)
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        return "its tools are not a list"
    if len(tools) > MAX_TOOLS:
        return f"it has {len(tools)} tools (at most {MAX_TOOLS})"
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return "a tool is not {'type': 'function', 'function': {'name': ...}}"
    return None


def effective_max_turns(asked: int | None, own: int) -> tuple[int, str]:
    """The most model turns of a run's episodes, and why: the spec's `episode.max_turns` when
    it is set (above or below the environment's own: the spec is the user's last word), else
    the environment's own `max_turns`."""
    own = max(1, own)
    if asked is None:
        return own, f"the environment's own max_turns ({own}); the spec sets none"
    if asked == own:
        return asked, f"the spec's episode.max_turns, the environment's own too ({own})"
    return asked, f"the spec's episode.max_turns, over the environment's own ({own})"


def episode_over(max_turns: int, turns: int, last: Feedback | None) -> bool:
    """Whether an episode of `turns` model turns, answered last by `last`, is over."""
    return turns >= max_turns or (last is not None and last.done)


def trajectory_reward(feedback: Sequence[Feedback]) -> float:
    """The trajectory's reward: the sum of its turns' contributions (of the turns answered so
    far, for an episode cut by max_turns or the token budget)."""
    return math.fsum(f.reward for f in feedback)

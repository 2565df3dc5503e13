"""The built-in environments (`BUILTIN_ENVIRONMENTS`), each a class with the protocol of
`protocol.py` and no state between calls.

- `retry_arithmetic`: the multi-turn task of the embedded default (a tiny arithmetic model with
  no chat template). The model answers a sum; a right answer ends the episode with reward
  1 / 2**turn_index (1, 0.5, 0.25, ...), a wrong one is answered " no\\n{prompt}" so the model
  answers the same sum again. As the model learns to be right the first time, the reward rises
  and the turns per episode fall.
- `calculator`: a tool-using task for chat models: tools `add` and `multiply`; each call's result
  (or error) is the observation, one JSON line per call; a turn with no tool call is the final
  answer, scored 1 or 0 by exact match with the row's answer.
"""

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.environments.protocol import Feedback, ToolCall, Turn

MAX_OPERAND = 10**12  # calculator operands beyond this are an error (a bound on results)


def _answer(row: Mapping[str, Any]) -> str:
    return str(row["answer"]).strip()


class RetryArithmetic:
    """Answer `37+58=`; wrong answers are asked again, each retry halving the reward."""

    tools: Sequence[dict] = ()

    def __init__(self, max_turns: int = 3) -> None:
        self.max_turns = max_turns

    def opening(self, row: Mapping[str, Any]) -> str:
        return str(row["prompt"])

    def step(
        self, row: Mapping[str, Any], turns: Sequence[Turn], feedback: Sequence[Feedback]
    ) -> Feedback:
        turn_index = len(turns) - 1
        if turns[-1].text.strip() == _answer(row):
            return Feedback("", 1.0 / 2**turn_index, done=True, role="user")
        last = len(turns) >= self.max_turns
        return Feedback("" if last else f" no\n{row['prompt']}", 0.0, done=last, role="user")


def _operand(arguments: Mapping[str, Any], name: str) -> float | int:
    if name not in arguments:
        raise ValueError(f"argument {name!r} is missing")
    value = arguments[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"argument {name!r} is not a number")
    if not math.isfinite(value) or abs(value) > MAX_OPERAND:
        raise ValueError(f"argument {name!r} is out of range (at most {MAX_OPERAND:.0e})")
    return value


def _binary(fn: Callable[[Any, Any], Any]) -> Callable[[Mapping[str, Any]], Any]:
    def call(arguments: Mapping[str, Any]) -> Any:
        extra = sorted(set(arguments) - {"a", "b"})
        if extra:
            raise ValueError(f"unexpected arguments {extra}")
        return fn(_operand(arguments, "a"), _operand(arguments, "b"))

    return call


def _number_tool(name: str, description: str) -> dict:
    number = {"type": "number"}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"a": number, "b": number},
                "required": ["a", "b"],
            },
        },
    }


CALCULATOR_TOOLS = {
    "add": _binary(lambda a, b: a + b),
    "multiply": _binary(lambda a, b: a * b),
}


class Calculator:
    """Compute the row's expression with the tools, then answer with the number alone."""

    tools: Sequence[dict] = (
        _number_tool("add", "The sum a + b."),
        _number_tool("multiply", "The product a * b."),
    )

    def __init__(self, max_turns: int = 6) -> None:
        self.max_turns = max_turns

    def opening(self, row: Mapping[str, Any]) -> str:
        return str(row["prompt"])

    def step(
        self, row: Mapping[str, Any], turns: Sequence[Turn], feedback: Sequence[Feedback]
    ) -> Feedback:
        turn = turns[-1]
        if not turn.tool_calls and not turn.parse_errors:
            reward = 1.0 if turn.text.strip() == _answer(row) else 0.0
            return Feedback("", reward, done=True)
        lines = [json.dumps({"error": error}) for error in turn.parse_errors]
        results = [self._call(call) for call in turn.tool_calls]
        lines += [json.dumps(result) for result in results]
        failed = len(turn.parse_errors) + sum("error" in result for result in results)
        return Feedback("\n".join(lines), 0.0, tool_errors=failed)

    @staticmethod
    def _call(call: ToolCall) -> dict[str, Any]:
        tool = CALCULATOR_TOOLS.get(call.name)
        if tool is None:
            return {"name": call.name[:64], "error": f"no tool {call.name[:64]!r}"}
        try:
            return {"name": call.name, "result": tool(call.arguments)}
        except ValueError as exc:
            return {"name": call.name, "error": str(exc)}


BUILTIN_ENVIRONMENTS: dict[str, Callable[[], Any]] = {
    "retry_arithmetic": RetryArithmetic,
    "calculator": Calculator,
}

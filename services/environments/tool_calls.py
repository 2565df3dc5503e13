"""The model's tool calls, parsed from its own chat format: `parse_turn(text, fmt)`.

Formats (a run's setting):
- `hermes` (Qwen2.5, Qwen3, Hermes): any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the text; the arguments
  may be a JSON string that encodes the object; a last block left open (generation stopped at
  the closing tag) is read to the end of the text.
- `llama3_json` (Llama 3.1+): a turn that is one JSON object `{"name": ..., "parameters": {...}}`
  (or several separated by `;`), optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` after the text.
- `none`: no tool calls; the text as it is.

Bounded: at most MAX_CALLS_PER_TURN calls a turn (the text after the last one read is dropped),
MAX_CALL_CHARS characters a call (MAX_JSON_CHARS for a JSON value that lists several), and the
arguments a JSON object. Malformed markup becomes a message in `Turn.parse_errors`, never an
exception; only an unknown format (a setting, checked before a run) raises ValueError.
"""

import json
from collections.abc import Callable
from typing import Any

from services.environments.protocol import ToolCall, Turn

TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral", "none")
MAX_CALLS_PER_TURN = 16
MAX_CALL_CHARS = 32 * 1024
MAX_JSON_CHARS = MAX_CALLS_PER_TURN * MAX_CALL_CHARS  # a JSON list of calls (mistral)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_MARK = "[TOOL_CALLS]"
_DECODER = json.JSONDecoder()


class _Calls:
    """The calls of one turn as they are read, bounded, with what went wrong."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []
        self.seen = 0

    @property
    def full(self) -> bool:
        return self.seen > MAX_CALLS_PER_TURN

    def add(self, value: Any, arguments_key: str) -> None:
        """One call read as JSON (`value`), its arguments under `arguments_key`."""
        self.seen += 1
        where = f"tool call {self.seen}"
        if self.full:
            self.errors.append(f"more than {MAX_CALLS_PER_TURN} tool calls: the rest ignored")
            return
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            self.errors.append(f"{where}: not an object with a string name")
            return
        arguments = value.get(arguments_key, value.get("arguments", {}))
        if isinstance(arguments, str):
            arguments = _loads(arguments)
        if not isinstance(arguments, dict):
            self.errors.append(f"{where} ({value['name'][:64]}): arguments are not an object")
            return
        self.calls.append(ToolCall(value["name"], arguments))

    def add_text(self, text: str, arguments_key: str) -> None:
        """One call as JSON text."""
        if len(text) > MAX_CALL_CHARS:
            self.seen += 1
            self.errors.append(f"tool call {self.seen}: over {MAX_CALL_CHARS} characters")
            return
        value = _loads(text)
        if value is _INVALID:
            self.seen += 1
            self.errors.append(f"tool call {self.seen}: not valid JSON")
            return
        self.add(value, arguments_key)

    def turn(self, text: str) -> Turn:
        return Turn(text, self.calls, self.errors)


_INVALID = object()


def _loads(text: str) -> Any:
    """The JSON value of `text`, or _INVALID (deep nesting included)."""
    if len(text) > MAX_CALL_CHARS:
        return _INVALID
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _INVALID


def _hermes(text: str) -> Turn:
    calls, outside, at = _Calls(), [], 0
    while not calls.full:
        start = text.find(HERMES_OPEN, at)
        if start < 0:
            break
        outside.append(text[at:start])
        body_at = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_at)
        body = text[body_at:] if end < 0 else text[body_at:end]
        calls.add_text(body.strip(), "arguments")
        at = len(text) if end < 0 else end + len(HERMES_CLOSE)
    outside.append(text[at:] if not calls.full else "")
    return calls.turn("".join(outside).strip())


def _json_values(text: str, calls: _Calls, arguments_key: str) -> str:
    """Read JSON values from `text` (separated by whitespace or `;`) into `calls`; a value that
    is a list is a list of calls. Returns the text left after the last value read."""
    at = 0
    while not calls.full:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text) or text[at] not in "[{":
            break
        try:
            value, end = _DECODER.raw_decode(text[: at + MAX_JSON_CHARS], at)
        except (ValueError, RecursionError):
            calls.seen += 1
            too_long = len(text) - at > MAX_JSON_CHARS
            why = f"over {MAX_JSON_CHARS} characters" if too_long else "not valid JSON"
            calls.errors.append(f"tool call {calls.seen}: {why}")
            return ""
        for one in value if isinstance(value, list) else [value]:
            calls.add(one, arguments_key)
        at = end
    return text[at:].strip()


def _llama3_json(text: str) -> Turn:
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG) :].strip()
    if not tagged and not body.startswith("{"):
        return Turn(text)
    calls = _Calls()
    rest = _json_values(body, calls, "parameters")
    if not calls.seen:
        calls.errors.append("tool call 1: not valid JSON")
    return calls.turn(rest)


def _mistral(text: str) -> Turn:
    mark = text.find(MISTRAL_MARK)
    if mark < 0:
        return Turn(text.strip())
    calls = _Calls()
    rest = _json_values(text[mark + len(MISTRAL_MARK) :], calls, "arguments")
    if not calls.seen:
        calls.errors.append("tool call 1: no JSON list after [TOOL_CALLS]")
    return calls.turn(" ".join(part for part in (text[:mark].strip(), rest) if part))


_PARSERS: dict[str, Callable[[str], Turn]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
    "mistral": _mistral,
    "none": Turn,
}


def parse_turn(text: str, fmt: str) -> Turn:
    """The model's turn `text` read in tool-call format `fmt` (one of TOOL_CALL_FORMATS)."""
    parser = _PARSERS.get(fmt)
    if parser is None:
        raise ValueError(f"unknown tool-call format {fmt!r} (one of {TOOL_CALL_FORMATS})")
    return parser(text)

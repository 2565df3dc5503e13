"""The tool-call parser on each format: good turns, several calls, arguments as a JSON string,
malformed and oversized markup (a parse error, never an exception), and the bounds."""

import json

import pytest

from services.environments.protocol import ToolCall, Turn
from services.environments.tool_calls import (
    MAX_CALL_CHARS,
    MAX_CALLS_PER_TURN,
    TOOL_CALL_FORMATS,
    parse_turn,
)


def hermes_call(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_hermes_reads_every_call_and_keeps_the_text_around_them():
    text = f"Let me add.\n{hermes_call('add', {'a': 1, 'b': 2})}{hermes_call('multiply', {})}"
    turn = parse_turn(text, "hermes")
    assert turn == Turn(
        "Let me add.", [ToolCall("add", {"a": 1, "b": 2}), ToolCall("multiply", {})], []
    )


def test_hermes_arguments_as_a_json_string_and_a_block_left_open():
    encoded = hermes_call("add", json.dumps({"a": 3, "b": 4}))
    assert parse_turn(encoded, "hermes").tool_calls == [ToolCall("add", {"a": 3, "b": 4})]
    left_open = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}'
    assert parse_turn(left_open, "hermes") == Turn("", [ToolCall("add", {"a": 1, "b": 1})], [])


def test_hermes_malformed_calls_are_parse_errors_and_good_ones_still_count():
    text = (
        "<tool_call>{not json}</tool_call>"
        + hermes_call("add", {"a": 1, "b": 2})
        + '<tool_call>{"arguments": {}}</tool_call>'
        + hermes_call("add", [1, 2])
        + hermes_call("add", "not an object")
    )
    turn = parse_turn(text, "hermes")
    assert turn.tool_calls == [ToolCall("add", {"a": 1, "b": 2})]
    assert turn.parse_errors == [
        "tool call 1: not valid JSON",
        "tool call 3: not an object with a string name",
        "tool call 4 (add): arguments are not an object",
        "tool call 5 (add): arguments are not an object",
    ]


def test_hermes_is_bounded_in_calls_size_and_depth():
    many = parse_turn(hermes_call("add", {"a": 1, "b": 1}) * 40 + " tail", "hermes")
    assert len(many.tool_calls) == MAX_CALLS_PER_TURN
    assert many.parse_errors == [f"more than {MAX_CALLS_PER_TURN} tool calls: the rest ignored"]
    big = parse_turn(hermes_call("add", {"a": "x" * MAX_CALL_CHARS}), "hermes")
    assert big.tool_calls == [] and "over" in big.parse_errors[0]
    deep = parse_turn("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", "hermes")
    assert deep.tool_calls == [] and deep.parse_errors == ["tool call 1: not valid JSON"]


def test_llama3_json_one_or_several_calls_with_or_without_the_python_tag():
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    want = [ToolCall("add", {"a": 1, "b": 2})]
    assert parse_turn(call, "llama3_json") == Turn("", want, [])
    assert parse_turn(f"<|python_tag|>{call}", "llama3_json").tool_calls == want
    assert len(parse_turn(f"{call}; {call}", "llama3_json").tool_calls) == 2
    string_args = '{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}'
    assert parse_turn(string_args, "llama3_json").tool_calls == want


def test_llama3_json_plain_text_is_an_answer_and_broken_json_a_parse_error():
    assert parse_turn("The answer is 3.", "llama3_json") == Turn("The answer is 3.")
    broken = parse_turn('<|python_tag|>{"name": "add", "parameters": {', "llama3_json")
    assert broken.tool_calls == [] and broken.parse_errors == ["tool call 1: not valid JSON"]
    no_name = parse_turn('{"answer": 3}', "llama3_json")
    assert no_name.parse_errors == ["tool call 1: not an object with a string name"]


def test_mistral_a_list_of_calls_after_the_marker():
    text = 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, ' + (
        '{"name": "multiply", "arguments": "{\\"a\\": 2, \\"b\\": 5}"}]'
    )
    turn = parse_turn(text, "mistral")
    assert turn == Turn(
        "Sure.", [ToolCall("add", {"a": 1, "b": 2}), ToolCall("multiply", {"a": 2, "b": 5})], []
    )
    assert parse_turn("just text", "mistral") == Turn("just text")
    assert parse_turn("[TOOL_CALLS] [{oops", "mistral").parse_errors == [
        "tool call 1: not valid JSON"
    ]
    assert parse_turn("[TOOL_CALLS] nothing", "mistral").parse_errors == [
        "tool call 1: no JSON list after [TOOL_CALLS]"
    ]


def test_none_keeps_the_text_and_an_unknown_format_is_refused():
    text = hermes_call("add", {"a": 1, "b": 2})
    assert parse_turn(text, "none") == Turn(text)
    assert set(TOOL_CALL_FORMATS) == {"hermes", "llama3_json", "mistral", "none"}
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_turn(text, "qwen_xml")


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_no_input_raises(fmt):
    for text in ("", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "\x00"):
        assert isinstance(parse_turn(text, fmt), Turn)

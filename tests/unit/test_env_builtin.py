"""The built-in environments played turn by turn (retry_arithmetic's rewards and turns, the
calculator's tool results and errors), and the choice of an environment: a built-in, or a user
`module:Class` from the allow list, refused without importing anything when off it."""

import json
import sys
from pathlib import Path

import pytest

from services.environments.builtin import BUILTIN_ENVIRONMENTS, Calculator, RetryArithmetic
from services.environments.choice import (
    EnvironmentChoice,
    EnvironmentLoadError,
    EnvironmentNotAllowed,
)
from services.environments.protocol import (
    Feedback,
    ToolCall,
    Turn,
    check_environment,
    check_feedback,
    episode_over,
    trajectory_reward,
)
from services.environments.tool_calls import parse_turn

ROW = {"prompt": "37+58=", "answer": "95", "a": 37, "b": 58}


def play(env, row, answers, fmt="none"):
    """An episode driven as the coordinator will: the model's answers in order, parsed, each
    answered, until the episode is over. Returns the turns and the feedback."""
    turns: list[Turn] = []
    feedback: list[Feedback] = []
    for text in answers:
        turns.append(parse_turn(text, fmt))
        feedback.append(check_feedback(env.step(row, turns, feedback[: len(turns) - 1])))
        if episode_over(env.max_turns, len(turns), feedback[-1]):
            break
    return turns, feedback


def test_retry_arithmetic_halves_the_reward_with_each_retry():
    env = RetryArithmetic()
    assert env.opening(ROW) == "37+58=" and env.tools == () and env.max_turns == 3
    for wrong, reward in ((0, 1.0), (1, 0.5), (2, 0.25)):
        turns, feedback = play(env, ROW, ["12"] * wrong + [" 95\n"])
        assert len(turns) == wrong + 1
        assert feedback[-1].done and trajectory_reward(feedback) == reward
        assert all(f.role == "user" for f in feedback)


def test_retry_arithmetic_asks_the_same_sum_again_then_gives_up_at_max_turns():
    turns, feedback = play(RetryArithmetic(), ROW, ["095", "94", "93", "95"])
    assert [f.observation for f in feedback] == [" no\n37+58=", " no\n37+58=", ""]
    assert [f.done for f in feedback] == [False, False, True]
    assert len(turns) == 3 and trajectory_reward(feedback) == 0.0


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


CALC_ROW = {"prompt": "What is (3 + 4) * 5?", "answer": "35"}


def test_calculator_answers_each_call_then_scores_the_final_answer():
    env = Calculator()
    assert check_environment(env) is None
    assert [t["function"]["name"] for t in env.tools] == ["add", "multiply"]
    answers = [call("add", a=3, b=4), call("multiply", a=7, b=5) + call("add", a=0.5, b=1), "35"]
    turns, feedback = play(env, CALC_ROW, answers, fmt="hermes")
    assert [json.loads(line) for line in feedback[0].observation.splitlines()] == [
        {"name": "add", "result": 7}
    ]
    assert [json.loads(line)["result"] for line in feedback[1].observation.splitlines()] == [
        35,
        1.5,
    ]
    assert feedback[0].role == "tool" and not feedback[0].done
    assert feedback[-1].done and trajectory_reward(feedback) == 1.0
    assert sum(len(t.tool_calls) for t in turns) == 3
    _, wrong = play(env, CALC_ROW, ["36"], fmt="hermes")
    assert wrong[-1].done and trajectory_reward(wrong) == 0.0


def test_calculator_observes_bad_calls_as_errors_and_counts_them():
    env = Calculator()
    bad = (
        call("subtract", a=1, b=2)
        + call("add", a="1", b=2)
        + call("add", a=1)
        + call("add", a=1, b=2, c=3)
        + call("multiply", a=1e13, b=1)
        + call("add", a=True, b=2)
        + "<tool_call>{broken</tool_call>"
        + call("add", a=1, b=2)
    )
    _, feedback = play(env, CALC_ROW, [bad], fmt="hermes")
    lines = [json.loads(line) for line in feedback[0].observation.splitlines()]
    assert lines[0] == {"error": "tool call 7: not valid JSON"}  # parse errors first
    errors = [line["error"] for line in lines[1:-1]]
    assert errors == [
        "no tool 'subtract'",
        "argument 'a' is not a number",
        "argument 'b' is missing",
        "unexpected arguments ['c']",
        "argument 'a' is out of range (at most 1e+12)",
        "argument 'a' is not a number",
    ]
    assert lines[-1] == {"name": "add", "result": 3}
    assert feedback[0].tool_errors == 7 and not feedback[0].done


def test_calculator_unknown_tool_names_are_cut_short():
    feedback = Calculator().step(CALC_ROW, [Turn("", [ToolCall("x" * 5000, {})], [])], [])
    assert len(feedback.observation) < 300 and feedback.tool_errors == 1


class UserEnv(RetryArithmetic):
    """A user's environment (this module is importable from the repository root)."""


class NotAnEnvironment:
    max_turns = 2


def test_choosing_a_built_in_or_an_allowed_user_class():
    for name, cls in BUILTIN_ENVIRONMENTS.items():
        choice = EnvironmentChoice(name)
        assert choice.builtin and choice.module is None
        choice.check_allowed(())
        assert isinstance(choice.load(), cls)
    user = EnvironmentChoice(f"{__name__}:UserEnv")
    user.check_allowed([__name__])
    assert isinstance(user.load(), UserEnv)


def test_a_module_off_the_allow_list_is_refused_before_it_is_imported():
    choice = EnvironmentChoice("tests.data.never_imported_env:Env")
    with pytest.raises(EnvironmentNotAllowed, match="not on the coordinator's allow list"):
        choice.check_allowed(["tests.unit.test_env_builtin"])
    assert "tests.data.never_imported_env" not in sys.modules


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("tests.data.no_such_module:Env", "No module named"),
        (f"{__name__}:Nope", "has no class 'Nope'"),
        (f"{__name__}:play", "has no class 'play'"),
        (f"{__name__}:NotAnEnvironment", "no method opening()"),
        ("no_colon", "neither a built-in nor module:Class"),
    ],
)
def test_what_cannot_be_loaded_says_why(name, problem):
    with pytest.raises(EnvironmentLoadError, match=problem):
        EnvironmentChoice(name).load()


def test_the_example_in_the_docs_works_as_pasted(tmp_path, monkeypatch):
    page = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    example = page.split("### An example to paste", 1)[1]
    source = example.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_envs.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    choice = EnvironmentChoice("my_envs:GuessNumber")
    choice.check_allowed(["my_envs"])
    env = choice.load()
    row = {"answer": "42"}
    assert "Guess it" in env.opening(row)
    _, feedback = play(env, row, ["50", "I say 25", "what?", "42"])
    assert [f.observation for f in feedback] == [
        "No: lower.",
        "No: higher.",
        "Answer with a number.",
        "",
    ]
    assert feedback[-1].done and trajectory_reward(feedback) == pytest.approx(0.7)
    sys.modules.pop("my_envs", None)

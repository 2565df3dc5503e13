"""The environment protocol's rules: what a feedback and an opening may be (anything else is a
bad feedback), an environment's shape, when an episode is over and the trajectory's reward; the
process's answer to a call (what raised or returned a bad value is said, never raised); the
sandbox's network decision."""

import math

import msgspec
import pytest

from services.environments import sandbox, worker
from services.environments.protocol import (
    MAX_OBSERVATION_CHARS,
    MAX_OPENING_CHARS,
    BadFeedback,
    Feedback,
    ToolCall,
    Turn,
    check_environment,
    check_feedback,
    check_opening,
    episode_over,
    trajectory_reward,
)
from services.environments.wire import Call, LoadEnvironment, OpeningCall, StepCall
from services.infra.frames import frame


def test_a_good_feedback_passes_with_its_reward_as_a_float():
    checked = check_feedback(Feedback("ok", reward=1, done=True, role="user"))
    assert checked == Feedback("ok", 1.0, True, "user")
    assert type(checked.reward) is float


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("text", "returned str, not a Feedback"),
        (None, "returned NoneType"),
        (Feedback(3), "observation is int"),  # type: ignore[arg-type]
        (Feedback("x" * (MAX_OBSERVATION_CHARS + 1)), "characters"),
        (Feedback("", math.nan), "not a finite number"),
        (Feedback("", math.inf), "not a finite number"),
        (Feedback("", "1"), "not a finite number"),  # type: ignore[arg-type]
        (Feedback("", 0.0, 1), "done is int"),  # type: ignore[arg-type]
        (Feedback("", 0.0, False, "assistant"), "role"),  # type: ignore[arg-type]
        (Feedback("", 0.0, False, "tool", -1), "not a count"),
    ],
)
def test_anything_else_is_a_bad_feedback(value, problem):
    with pytest.raises(BadFeedback, match=problem):
        check_feedback(value)


def test_an_opening_is_a_bounded_string():
    assert check_opening("37+58=") == "37+58="
    with pytest.raises(BadFeedback, match="not str"):
        check_opening(b"37+58=")
    with pytest.raises(BadFeedback, match="characters"):
        check_opening("x" * (MAX_OPENING_CHARS + 1))


class Shaped:
    tools = ({"type": "function", "function": {"name": "add", "parameters": {}}},)
    max_turns = 4

    def opening(self, row):
        return ""

    def step(self, row, turns, feedback):
        return Feedback("")


def test_an_environment_needs_its_methods_max_turns_and_function_tools():
    assert check_environment(Shaped()) is None
    cases = {
        "no method step": {"step": None},
        "max_turns is not an int": {"max_turns": 2.0},
        "max_turns 0 is not in": {"max_turns": 0},
        "tools are not a list": {"tools": "add"},
        "a tool is not": {"tools": [{"name": "add"}]},
    }
    for problem, attributes in cases.items():
        env = Shaped()
        for name, value in attributes.items():
            setattr(env, name, value)
        assert problem in (check_environment(env) or ""), problem


def test_an_episode_ends_when_done_or_at_max_turns_and_keeps_its_rewards_so_far():
    assert not episode_over(3, 1, None)
    assert not episode_over(3, 2, Feedback("no"))
    assert episode_over(3, 2, Feedback("", 0.5, done=True))
    assert episode_over(3, 3, Feedback("no"))  # cut: the reward so far stands
    assert trajectory_reward([Feedback("", 0.25), Feedback("", 0.5, done=True)]) == 0.75
    assert trajectory_reward([]) == 0.0


def test_the_wire_carries_turns_and_feedback_as_typed_msgpack():
    step = StepCall(
        {"prompt": "1+1="}, [Turn("hi", [ToolCall("add", {"a": 1})], ["bad"])], [Feedback("x")]
    )
    for message in (step, OpeningCall({"prompt": "1+1="})):
        assert msgspec.msgpack.decode(frame(message)[4:], type=Call) == message
    load = LoadEnvironment("calculator", 0, True)
    assert msgspec.msgpack.decode(frame(load)[4:], type=LoadEnvironment) == load


class Answers:
    tools = ()
    max_turns = 2

    def opening(self, row):
        return row["opening"]

    def step(self, row, turns, feedback):
        if row.get("raise"):
            raise KeyError("boom")
        return row["feedback"]


def test_the_process_says_what_raised_or_was_bad_and_never_raises():
    env = Answers()
    ok = worker.answer(env, StepCall({"feedback": Feedback("y", 1.0)}, [Turn("")], []))
    assert ok.error == "" and ok.feedback == Feedback("y", 1.0)
    raised = worker.answer(env, StepCall({"raise": True}, [Turn("")], []))
    assert (raised.error, raised.detail) == ("raised", "KeyError: 'boom'")
    bad = worker.answer(env, StepCall({"feedback": "y"}, [Turn("")], []))
    assert bad.error == "bad_feedback" and "not a Feedback" in bad.detail
    assert worker.answer(env, OpeningCall({"opening": "hi"})).opening == "hi"
    assert worker.answer(env, OpeningCall({"opening": 3})).error == "bad_feedback"


def test_no_network_namespace_is_a_refusal_with_both_reasons(monkeypatch):
    tried = []

    def refuse(flags):
        tried.append(flags)
        raise OSError(1, "Operation not permitted")

    reason = sandbox.isolate_network(refuse)
    assert tried == [sandbox.CLONE_NEWNET, sandbox.CLONE_NEWUSER | sandbox.CLONE_NEWNET]
    assert reason is not None and reason.count("Operation not permitted") == 2
    assert sandbox.isolate_network(lambda flags: None) is None
    # the process answers the runner with the refusal, before importing any environment
    monkeypatch.setattr(worker, "isolate_network", lambda: "refused here")
    loaded, env = worker.load(LoadEnvironment("tests.data.no_such_module:Env", 0, True))
    assert env is None and loaded.network_refused and "refused here" in loaded.error

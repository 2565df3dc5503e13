"""When failing calls of a run's user code end the run (services.core.call_errors), the
effective max_turns of its episodes (services.environments.protocol.effective_max_turns), and
where a user's exception is told to come from (services.infra.user_errors)."""

import pytest

from services.core.call_errors import CallCount, judge, run_health
from services.environments.protocol import effective_max_turns
from services.infra.user_errors import defined_at, trace_text, user_frame

FIRST = "bad_feedback: step returned dict, not a Feedback (at envs.py:3 in Env.step)"


def test_a_step_whose_calls_all_fail_fails_the_run_with_the_count_and_the_first_error():
    counts = {"environment": CallCount(256, 256, FIRST), "reward": CallCount()}
    verdict = judge(counts, 0.5, "in step 0")
    assert verdict.health == "failed"
    assert verdict.reason == (
        "environment failed on 256 of 256 calls in step 0 (more than "
        f"faults.max_error_share 0.5): {FIRST} (first traceback in the run's log)"
    )


@pytest.mark.parametrize(
    ("failed", "health"), [(0, "ok"), (1, "degraded"), (50, "degraded"), (51, "failed")]
)
def test_the_threshold_is_a_share_of_the_steps_calls(failed, health):
    assert judge({"reward": CallCount(100, failed)}, 0.5, "in step 3").health == health


def test_each_kind_is_judged_on_its_own_calls():
    counts = {"environment": CallCount(10, 1), "reward": CallCount(4, 3, "raised: boom")}
    verdict = judge(counts, 0.5, "in step 1")
    assert verdict.health == "failed" and verdict.reason.startswith("reward failed on 3 of 4")
    assert judge({"reward": CallCount(0, 0)}, 0.0, "x").health == "ok"  # no call, no share
    assert judge({"reward": CallCount(4, 4)}, 1.0, "x").health == "degraded"  # 1.0: never fails


def test_a_runs_health_is_failed_by_one_bad_step_and_degraded_by_any_failure():
    healthy = {"environment": CallCount(10, 0)}
    some = {"environment": CallCount(10, 2, "raised: boom (at e.py:1 in step)")}
    verdict, totals = run_health([healthy, some], 0.5)
    assert verdict.health == "degraded" and "2 of 20 calls over the run" in verdict.reason
    assert totals["environment"] == {
        "calls": 20,
        "failed": 2,
        "share": 0.1,
        "first": "raised: boom (at e.py:1 in step)",
    }
    assert totals["reward"]["calls"] == 0
    verdict, _ = run_health([healthy, some, {"environment": CallCount(4, 4)}], 0.5)
    assert verdict.health == "failed" and "in step 2" in verdict.reason
    assert run_health([healthy], 0.5)[0].health == "ok"


def test_max_turns_is_the_specs_when_set_else_the_environments_own():
    assert effective_max_turns(None, 7)[0] == 7  # the docs' GuessNumber: its own 7
    assert effective_max_turns(2, 7)[0] == 2
    assert effective_max_turns(9, 7) == (
        9,
        "the spec's episode.max_turns, over the environment's own (7)",
    )
    assert "the spec sets none" in effective_max_turns(None, 3)[1]


def _raise_in_user_code():
    values: dict = {}
    return values["missing"]


def test_a_user_exception_is_told_by_its_own_frame_and_traceback():
    with pytest.raises(KeyError) as caught:
        _raise_in_user_code()
    assert user_frame(caught.value).startswith("test_call_errors.py:")
    assert user_frame(caught.value).endswith("in _raise_in_user_code")
    assert "KeyError: 'missing'" in trace_text(caught.value)
    assert defined_at(_raise_in_user_code).endswith("in _raise_in_user_code")
    assert user_frame(KeyError("never raised")) == "" and defined_at(len) == ""

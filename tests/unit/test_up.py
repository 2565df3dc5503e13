"""`spotrl up`'s decisions: when to restart a dead worker, when to stop waiting for a run, what
to print about a death or a stall, and a folder of its own per invocation."""

import json

import pytest

from services.cli.follow import progress_info, state_change_line
from services.cli.local_commands import parse_env
from services.cli.main import build_parser
from services.cli.supervisor import (
    Backoff,
    RestartPolicy,
    StallGuard,
    error_headline,
    exit_description,
)
from services.cli.up import new_run_dir
from services.cli.up_summary import summarize


def test_backoff_doubles_from_one_second_up_to_the_cap():
    backoff = Backoff(first_s=1.0, max_s=30.0)
    assert [backoff.delay_s(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_restarts_back_off_while_a_worker_keeps_dying_and_reset_once_it_stayed_up():
    policy = RestartPolicy(Backoff(first_s=1.0, max_s=30.0, stable_after_s=60.0))
    policy.started("w", now=0.0)
    assert policy.due(100.0) == []  # alive: nothing to do
    assert policy.died("w", now=5.0) == 1.0
    assert policy.due(5.5) == []
    assert policy.due(6.0) == ["w"]
    policy.started("w", now=6.0)
    assert policy.due(100.0) == []  # restarted once, not again
    assert policy.died("w", now=10.0) == 2.0  # died again soon: twice the wait
    assert policy.crash_looping()
    policy.started("w", now=12.0)
    assert policy.died("w", now=13.0) == 4.0
    policy.started("w", now=17.0)
    assert policy.died("w", now=17.0 + 60.0) == 1.0  # stayed up a minute: from the start
    assert not policy.crash_looping()
    assert policy.restarts == 1  # `due` counts the restarts it hands out


def test_crash_loop_needs_every_slot_to_have_died_after_a_restart():
    policy = RestartPolicy()
    for slot in ("a", "b"):
        policy.started(slot, 0.0)
    assert not policy.crash_looping()
    for now in (1.0, 3.0):
        policy.died("a", now)
        policy.started("a", now + 1)
    assert not policy.crash_looping()  # b is fine
    for now in (1.0, 3.0):
        policy.died("b", now)
        policy.started("b", now + 1)
    assert policy.crash_looping()
    assert not RestartPolicy().crash_looping()  # nothing supervised: never


def run(state="running", step=0, reason=""):
    return {"id": "r1", "state": state, "step": step, "stall_reason": reason}


def test_stall_guard_stops_after_the_timeout_plus_margin_of_stall():
    guard = StallGuard(timeout_s=10.0, margin_s=5.0)
    assert guard.check(run("stalled", reason="no live worker"), 0.0, False, "") is None
    assert guard.check(run("stalled", reason="no live worker"), 15.0, False, "") is None
    reason = guard.check(run("stalled", reason="no live worker"), 15.5, False, "")
    assert reason == "stalled for over 10 s: no live worker"


def test_stall_guard_forgets_a_stall_that_ended():
    guard = StallGuard(timeout_s=10.0, margin_s=5.0)
    guard.check(run("stalled"), 0.0, False, "")
    guard.check(run("running"), 8.0, False, "")
    assert guard.check(run("stalled"), 9.0, False, "") is None
    assert guard.check(run("stalled"), 23.0, False, "") is None  # 14 s into the new stall


def test_stall_guard_stops_when_every_worker_crash_loops_without_progress():
    guard = StallGuard(timeout_s=10.0)
    assert guard.check(run(step=0), 0.0, True, "E: boom") is None
    assert guard.check(run(step=1), 9.0, True, "E: boom") is None  # a step finished at 9
    assert guard.check(run(step=1), 18.0, True, "E: boom") is None
    reason = guard.check(run(step=1), 19.5, True, "E: boom")
    assert reason and "keeps dying" in reason and reason.endswith("last error: E: boom")
    assert guard.check(run(step=1), 19.5, False, "") is None  # workers that stay up: wait


def test_stall_guard_without_timeout_waits_for_ever():
    guard = StallGuard(timeout_s=None)
    assert guard.check(run("stalled"), 0.0, True, "") is None
    assert guard.check(run("stalled"), 1e6, True, "") is None


def test_error_headline_is_the_tracebacks_exception_line():
    log = """2026 rollout[w] INFO started
2026 rollout[w] CRITICAL services.infra.service: background task jobs died; shutting down
Traceback (most recent call last):
  File "x.py", line 1, in f
    raise AssertionError("Torch not compiled with CUDA enabled")
AssertionError: Torch not compiled with CUDA enabled
2026 rollout[w] INFO services.rollout.app: preemption notice: released 0 requests
"""
    assert error_headline(log) == "AssertionError: Torch not compiled with CUDA enabled"
    assert error_headline("a\nValueError in thing\nbye\n") == "ValueError in thing"
    assert error_headline("a\nlast words\n") == ""  # nothing says why: killed from outside
    assert error_headline("") == ""
    assert exit_description(-9) == "killed by SIGKILL" and exit_description(3) == "exit code 3"


def test_progress_shows_the_stall_and_its_reason_and_a_note():
    r = {"id": "r1", "state": "stalled", "stall_reason": "no live worker holds version 3"}
    r |= {"reward_mean": 0.5, "tokens_per_s": None}
    info = progress_info(r, 0, "worker restarts 2")
    assert info.startswith("stalled (no live worker holds version 3)  reward 0.500")
    assert info.endswith("workers 0  worker restarts 2")


def test_a_stall_is_announced_once_and_its_end_too():
    assert state_change_line(None, run("running")) is None
    stalled = run("stalled", reason="no live worker")
    assert state_change_line(run("running"), stalled) == "run r1 stalled: no live worker"
    assert state_change_line(stalled, stalled) is None
    other = run("stalled", reason="request crashed 3 workers")
    assert state_change_line(stalled, other) == "run r1 stalled: request crashed 3 workers"
    assert state_change_line(stalled, run("running")) == "run r1 running again"


def test_each_invocation_gets_its_own_folder(tmp_path):
    folders = {new_run_dir(tmp_path) for _ in range(20)}  # all in the same second
    assert len(folders) == 20 and all(f.is_dir() for f in folders)


def test_up_options_for_port_stall_timeout_and_worker_env():
    args = build_parser().parse_args(
        ["up", "--port", "8123", "--stall-timeout-s", "30", "--worker-env", "SPOTRL_DEVICE=cuda"]
    )
    assert (args.port, args.stall_timeout_s, args.worker_env) == (
        8123,
        30.0,
        ["SPOTRL_DEVICE=cuda"],
    )
    assert build_parser().parse_args(["up"]).stall_timeout_s == 300.0
    assert parse_env(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_env(["nope"])


def test_the_final_summary_prints_figures_rounded_and_the_runs_health():
    run = {
        "id": "r1",
        "state": "succeeded",
        "step": 2,
        "groups_incomplete": 0,
        "n_prem_recommended": 2.3333333333333335,
        "health": "degraded",
        "errors": {"environment": {"calls": 40, "failed": 3, "share": 0.075, "first": "x"}},
    }
    rows = [
        {"reward_mean": 0.3976562500000006, "tokens_per_s": 101.26, "step_s": 1.23456},
        {"reward_mean": 0.46000000000000013, "tokens_per_s": 99.9, "t_seed_s": 0.123456},
    ]
    summary = summarize(run, rows, wall_s=12.345)
    assert (summary["reward_first"], summary["reward_last"]) == (0.3977, 0.46)
    assert (summary["tokens_per_s_mean"], summary["step_s_mean"]) == (100.6, 1.23)
    assert (summary["t_seed_s_last"], summary["n_prem_recommended"]) == (0.12, 2.33)
    assert summary["health"] == "degraded" and summary["errors"] == run["errors"]
    assert "0.3976562500000006" not in json.dumps(summary)


def test_the_summary_says_whether_the_run_learned_and_where_its_steps_went():
    """The means of the first and the last 10 steps' rewards, of rollout and of whole steps:
    what the long-response task's run is judged by (rollout most of the step)."""
    run = {"id": "r1", "state": "succeeded", "step": 25, "groups_incomplete": 0}
    rows = [
        {"reward_mean": k / 100, "rollout_s": 2.0 + k % 2, "step_s": 4.0, "response_len_mean": 60}
        for k in range(25)
    ]
    summary = summarize(run, rows, wall_s=100.0)
    assert (summary["reward_first10_mean"], summary["reward_last10_mean"]) == (0.045, 0.195)
    assert (summary["rollout_s_mean"], summary["step_s_mean"]) == (2.48, 4.0)
    assert summary["response_len_mean"] == 60.0
    few = summarize(run | {"step": 3}, rows[:3], wall_s=1.0)
    assert few["reward_first10_mean"] == few["reward_last10_mean"] == 0.01


def test_the_base_model_up_builds_is_the_tasks_and_rebuilt_when_its_spec_changed(tmp_path):
    """`spotrl up` and `init-model` build arithmetic's model as ever (1000 steps), a task's
    own defaults for long_addition; its own folder is rebuilt when the spec recorded there is
    another (a model built before the task's defaults changed), a folder the user names never."""
    from services.cli.up import base_model_spec, built_with
    from services.trainer.init_model import TASK_MODEL_DEFAULTS, InitModelSpec

    assert base_model_spec("arithmetic", None, None) == InitModelSpec(pretrain_steps=1000)
    long = base_model_spec("long_addition", None, None)
    assert long.model_dump(include=set(TASK_MODEL_DEFAULTS["long_addition"])) == dict(
        TASK_MODEL_DEFAULTS["long_addition"]
    )
    assert base_model_spec("long_addition", None, 7).pretrain_steps == 7
    assert built_with(tmp_path) is None
    (tmp_path / "spotrl-init.json").write_text(long.model_dump_json())
    assert built_with(tmp_path) == long != base_model_spec("long_addition", None, 7)
    # a spec recorded before a field existed reads as that field's default
    old = InitModelSpec(pretrain_steps=1000).model_dump(exclude={"group_by_length"})
    (tmp_path / "spotrl-init.json").write_text(json.dumps(old))
    assert built_with(tmp_path) == base_model_spec("arithmetic", None, None)

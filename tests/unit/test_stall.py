"""The stall and poison policies (services/core/stall.py) and the crash bookkeeping of the
request table: plain functions, a made-up clock."""

from services.contracts.messages import Heartbeat
from services.contracts.runspec import RunSpec
from services.core.collect import CollectRules, note_crash
from services.core.stall import (
    Action,
    Blocker,
    GoneWorker,
    StallTracker,
    WorkerView,
    blocker,
    is_poison,
)
from services.core.step_controller import serves
from tests import factories


def test_a_worker_holding_or_loading_the_version_is_able():
    assert blocker(3, [WorkerView("w1", 3)], []) is None
    assert blocker(3, [WorkerView("w1", 2)], []) is None  # loading v3: coming
    assert blocker(3, [WorkerView("w1", None)], []) is None  # just joined
    crashed = WorkerView("w2", 3, error="RuntimeError: boom")
    assert blocker(3, [crashed, WorkerView("w1", 3)], []) is None


def test_no_able_worker_names_what_is_wrong():
    gone = [
        GoneWorker("rollout-preemptible-1", "lost"),
        GoneWorker("rollout-preemptible-2", "crashed", "RuntimeError: CUDA error"),
    ]
    why = blocker(4, [], gone)
    assert why is not None
    assert why.headline == "no live rollout worker able to serve version 4"
    assert "2 left: rollout-preemptible-1 lost, rollout-preemptible-2 crashed" in why.detail
    assert "last error: rollout-preemptible-2: RuntimeError: CUDA error" in why.detail
    assert "joined" in blocker(0, [], []).detail


def test_crashing_and_stepped_aside_workers_cannot_serve():
    aside = WorkerView("rollout-reserved-1", 2, paused=True)
    dying = WorkerView("rollout-preemptible-3", 2, error="ValueError: bad weights")
    why = blocker(2, [aside, dying], [])
    assert why is not None
    assert "1 crashing: rollout-preemptible-3" in why.detail
    assert "1 reserved stepped aside for training: rollout-reserved-1" in why.detail
    assert "last error: rollout-preemptible-3: ValueError: bad weights" in why.detail
    # paused for an older version: it serves the new one once loaded (the step controller's one
    # definition decides whether a paused worker stepped aside for the version)
    older = Heartbeat(
        worker_id="rollout-reserved-1", pool="reserved", run_id="r", version=2, paused=True,
        active=0, slots=8, tokens_generated=0, at=0.0,
    )  # fmt: skip
    assert serves(older, "r", 3) and not serves(older, "r", 2)


def test_many_gone_workers_are_counted_not_listed():
    gone = [GoneWorker(f"w{i}", "lost") for i in range(10)]
    why = blocker(0, [], gone)
    assert "10 left: w0 lost, w1 lost, w2 lost and 7 more" in why.detail


NOBODY = Blocker("no live rollout worker able to serve version 1", "1 left: w1 lost")


def test_stalled_only_after_stall_after_s_then_running_again():
    t = StallTracker(stall_after_s=3.0)
    assert t.observe(100.0, None).action is Action.NONE
    assert t.observe(101.0, NOBODY).action is Action.NONE  # blocked from 101
    assert t.observe(103.9, NOBODY).action is Action.NONE
    d = t.observe(104.2, NOBODY)
    assert d.action is Action.STALL
    assert d.reason == "no live rollout worker able to serve version 1 for 3s (1 left: w1 lost)"
    assert t.stalled_since == 104.2
    assert t.observe(110.0, NOBODY).action is Action.NONE  # same reason: nothing to write
    assert t.observe(111.0, None).action is Action.RESUME
    assert t.stalled_since is None and t.reason == ""
    assert t.observe(112.0, None).action is Action.NONE


def test_a_short_gap_does_not_stall():
    t = StallTracker(stall_after_s=3.0)
    t.observe(0.0, NOBODY)
    t.observe(2.0, None)  # a worker came back in time
    assert t.observe(4.0, NOBODY).action is Action.NONE  # blocked again from 4.0
    assert t.observe(7.5, NOBODY).action is Action.STALL


def test_a_new_reason_is_written_and_the_timeout_fails_the_run():
    t = StallTracker(stall_after_s=1.0, timeout_s=10.0)
    t.observe(0.0, NOBODY)
    assert t.observe(1.0, NOBODY).action is Action.STALL
    worse = Blocker(NOBODY.headline, "1 left: w1 crashed; last error: w1: OOM")
    d = t.observe(5.0, worse)
    assert d.action is Action.UPDATE and "last error: w1: OOM" in d.reason and "for 5s" in d.reason
    assert t.observe(10.9, worse).action is Action.NONE
    d = t.observe(11.0, worse)
    assert d.action is Action.FAIL
    assert d.reason.startswith("stalled for 10s (stall_timeout_s): no live rollout worker")


def test_a_stall_restored_after_a_restart_keeps_its_start():
    t = StallTracker(stall_after_s=3.0, timeout_s=60.0)
    t.restore(1000.0, "no live rollout worker able to serve version 1 for 3s")
    d = t.observe(1010.0, NOBODY)
    assert d.action is Action.UPDATE and "for 10s" in d.reason
    assert t.observe(1060.0, NOBODY).action is Action.FAIL
    t = StallTracker(stall_after_s=3.0)
    t.restore(1000.0, "x")
    assert t.observe(1001.0, None).action is Action.RESUME


def test_poison_needs_k_crashes_the_last_one_alone():
    assert not is_poison(1, alone=False, max_crashes=1)  # a bystander may have been the cause
    assert is_poison(1, alone=True, max_crashes=1)
    assert not is_poison(2, alone=True, max_crashes=3)
    assert is_poison(3, alone=True, max_crashes=3)
    assert not is_poison(3, alone=False, max_crashes=3)


def table():
    return factories.table(3, 2, 4)


def test_a_crash_makes_suspects_that_run_isolated():
    t = table()
    assert not t.job("0:1:0").isolate
    assert t.note_crash("0:1:0", 0, "w1")
    job = t.migrate("0:1:0", "crash", lease=0)
    assert job is not None and job.isolate and job.lease == 1
    assert not t.note_crash("0:1:0", 0, "w2")  # an old lease: that crash was counted already
    assert t.note_crash("0:1:0", 1, "w1")  # the same worker again (restarted): counted once
    assert t.requests["0:1:0"].crashed_on == ["w1"]
    assert t.note_crash("0:1:0", 1, "w2")
    assert t.requests["0:1:0"].crashed_on == ["w1", "w2"]


def test_a_quarantined_group_completes_and_nothing_of_it_moves():
    t = table()
    t.quarantine(1)
    assert 1 not in t.pending_groups and t.quarantined == {1}
    assert t.migrate("0:1:1", "death", lease=0) is None
    assert not t.note_crash("0:1:1", 0, "w1")
    assert not any(rid.startswith("0:1:") for rid in t.unfinished())
    assert len(t.unfinished()) == 4
    t.quarantine(0)
    t.quarantine(2)
    assert t.complete


def test_a_poison_request_drops_its_group_or_is_left_to_fail_the_run():
    spec = CollectRules.for_run(RunSpec(model="m", max_request_crashes=2))
    t = table()
    assert note_crash(t, spec, "0:2:1", 0, "w1", alone=False) is False  # 1 crash, bystanders
    t.migrate("0:2:1", "crash", lease=0)
    assert note_crash(t, spec, "0:2:1", 0, "w2", alone=True) is None  # an old lease
    assert note_crash(t, spec, "0:2:1", 1, "w2", alone=True) is True
    assert t.quarantined == {2} and 2 not in t.pending_groups
    group = t.dropped_group(2)
    assert group.quarantined and group.responses == [] and group.prompt_index == 2
    t = table()
    fail = CollectRules.for_run(RunSpec(model="m", max_request_crashes=2, on_poison="fail_run"))
    note_crash(t, fail, "0:2:1", 0, "w1", alone=True)
    t.migrate("0:2:1", "crash", lease=0)
    assert note_crash(t, fail, "0:2:1", 1, "w2", alone=True) is True
    assert t.quarantined == set()  # the run fails instead

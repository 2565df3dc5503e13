"""The deciding core the coordinator and the simulator share: a read of delta batches applied to
a step (`core.collect`), the balancer's release cooldown, and what a step's times make of T_seed
and N_prem (`core.seeding.after_step`)."""

import math
from dataclasses import replace

import pytest

from services.contracts.messages import DeltaBatch, RequestLease
from services.core.balancer import ReleaseGate
from services.core.collect import CollectRules, keeps_tokens, split_by_step
from services.core.seeding import (
    SeedingController,
    StepTimes,
    after_step,
    recommended_pool_size,
    seeding_over,
    train_compute_s,
)
from tests import factories
from tests.conftest import apply_held
from tests.unit.test_request_table import delta, table


def batch(worker, items, released=(), reason="preemption"):
    return DeltaBatch(
        worker_id=worker,
        version=0,
        items=items,
        released=[RequestLease(request_id=r, lease=lease) for r, lease in released],
        release_reason=reason,
    )


def test_a_read_reports_changes_finished_responses_and_stale_deltas():
    t = table(n=2, prompts=2, max_new=3)
    out = apply_held(
        t,
        [
            batch("w1", [delta("0:0:0", 0, [5, 6]), delta("0:0:1", 0, [7, 8, 9])]),
            batch("w2", [delta("0:1:0", 0, [1], lease=3)]),  # a lease it no longer holds
        ],
        CollectRules(),
    )
    assert out.changed == {"0:0:0", "0:0:1"}
    assert out.finished == ["0:0:1"]
    assert out.stale == {"w2": {("0:1:0", 3)}}
    assert out.tokens_appended == 5
    assert out.applied == {"appended": 1, "finished": 1, "stale_lease": 1}
    assert out.released == {} and out.dropped == [] and out.poisoned == []


def test_released_requests_continue_after_their_flushed_tokens():
    t = table(n=1, prompts=2, max_new=5)
    out = apply_held(
        t,
        [batch("w1", [delta("0:0:0", 0, [5, 6])], released=[("0:0:0", 0)], reason="balance")],
        CollectRules(),
    )
    (job,) = out.released["balance"]
    assert job.request_id == "0:0:0" and job.lease == 1 and job.prefix_ids == [5, 6]
    assert job.remaining_tokens == 3
    # the same release again (a repeated flush) moves nothing: the lease moved on
    again = apply_held(t, [batch("w1", [], released=[("0:0:0", 0)])], CollectRules())
    assert again.released == {}


@pytest.mark.parametrize(
    ("migration", "cause", "keeps"),
    [
        (True, "preemption", True),
        (False, "preemption", False),
        (False, "death", False),
        (False, "seed", True),
        (False, "balance", True),
        (False, "crash", True),
    ],
)
def test_without_migration_only_a_lost_worker_discards_tokens(migration, cause, keeps):
    assert keeps_tokens(migration, cause) is keeps
    t = table(n=1, prompts=1, max_new=5)
    reason = cause if cause != "death" else "preemption"
    rules = CollectRules(migration=migration)
    if cause == "death":  # the coordinator reclaims a dead worker's requests itself
        apply_held(t, [batch("w1", [delta("0:0:0", 0, [5])])], rules)
        job = t.migrate("0:0:0", "death", keeps_tokens(migration, "death"), 0)
    else:
        out = apply_held(t, [batch("w1", [delta("0:0:0", 0, [5])], [("0:0:0", 0)], reason)], rules)
        (job,) = out.released[reason]
    assert job.prefix_ids == ([5] if keeps else [])
    assert t.tokens_discarded == (0 if keeps else 1)


def test_a_request_that_crashes_workers_alone_drops_its_group():
    t = table(n=2, prompts=2, max_new=5)
    rules = CollectRules(max_request_crashes=2)
    first = apply_held(t, [batch("w1", [], [("0:1:0", 0)], "crash")], rules)
    assert first.poisoned == [] and len(first.released["crash"]) == 1
    second = apply_held(t, [batch("w2", [], [("0:1:0", 1)], "crash")], rules)
    assert second.poisoned == [("0:1:0", "w2")] and second.released == {}
    assert second.dropped == [1] and t.quarantined == {1}
    assert t.dropped_group(1).quarantined
    # with on_poison=fail_run nothing is dropped: the shell fails the run
    t = table(n=2, prompts=2, max_new=5)
    fail = CollectRules(max_request_crashes=1, drop_poison=False)
    out = apply_held(t, [batch("w1", [], [("0:1:0", 0)], "crash")], fail)
    assert out.poisoned == [("0:1:0", "w1")] and out.dropped == [] and not t.quarantined


def test_groups_complete_once_every_response_is_in_and_carry_the_rewards():
    t = table(n=2, prompts=2, max_new=2)
    out = apply_held(t, [batch("w", [delta("0:0:0", 0, [4, 5])])], CollectRules())
    assert t.completed_groups(out.finished) == []  # its sibling is still running
    out = apply_held(t, [batch("w", [delta("0:0:1", 0, [6], finished=True)])], CollectRules())
    assert t.completed_groups(out.finished) == [0]
    with pytest.raises(ValueError, match="never scored"):
        t.group_message(0)
    t.score({"0:0:0": 1.0, "0:0:1": 0.0})
    group = t.group_message(0)
    assert [r.reward for r in group.responses] == [1.0, 0.0]
    assert [r.token_ids for r in group.responses] == [[4, 5], [6]]
    assert t.mean_reward() == 0.5
    t.mark_published([0])
    assert t.completed_groups(out.finished) == [] and t.pending_groups == {1}


def test_release_gate_lets_one_order_per_worker_through_per_cooldown():
    gate = ReleaseGate(cooldown_s=1.0)
    assert gate.due({"a": 2, "b": 1}, now=10.0) == ({"a": 2, "b": 1}, [])
    assert gate.due({"a": 1}, now=10.5) == ({}, [11.0])
    assert gate.due({"a": 1, "c": 3}, now=11.0) == ({"a": 1, "c": 3}, [])


def test_after_step_moves_t_seed_and_sizes_the_pool_from_the_step_times():
    controller = SeedingController(t_seed_s=10.0, eta=2.0)
    times = StepTimes(
        n_preemptible=4,
        n_reserved=2,
        started=100.0,
        seed_end=115.0,  # seeded 15 s (weights loaded, then the window)
        rollout_end=160.0,  # the preemptible pool worked 45 s
        committed=170.0,  # and idled 10 s at the end
        train_compute_s=30.0,
        train_wait_s=4.0,
    )
    update = after_step(controller, times)
    assert update.t_remote_wait_s == 10.0
    # the trainer waited 4 s after the window; its share is 5% of 30 s of compute
    assert update.t_seed_next_s == 10.0 + (4.0 - 0.05 * 30.0) / 2.0 == controller.t_seed_s
    assert update.n_prem_recommended == recommended_pool_size(45.0, 4, 15.0, 2, 30.0)
    frozen = SeedingController(t_seed_s=10.0)
    assert after_step(frozen, times, adapt=False).t_seed_next_s == 10.0
    # no reserved worker: the trainer waited on the pool alone, and T_seed must not grow
    no_reserved = replace(times, n_reserved=0, train_wait_s=60.0)
    assert after_step(SeedingController(t_seed_s=10.0), no_reserved).t_seed_next_s == 10.0
    alone = after_step(SeedingController(), StepTimes(0, 1, 0.0, None, 50.0, 60.0, 20.0, 0.0))
    assert alone.n_prem_recommended == 0.0  # no pool, no seeding span: nothing to add
    assert math.isinf(
        after_step(SeedingController(), StepTimes(0, 1, 0, None, 1, 2, 0, 0)).n_prem_recommended
    )


def test_train_compute_is_the_wall_time_less_the_waits():
    assert train_compute_s(10.0, 3.0, 2.0) == 5.0
    assert train_compute_s(1.0, 1.0, 0.5) == 1e-3


def test_the_reserved_pool_steps_aside_only_for_a_pool_that_can_take_over():
    assert seeding_over(0.0, None, 5.0, n_reserved=0, n_preemptible=0)  # it is gone
    assert not seeding_over(100.0, None, 5.0, 1, 2)  # it never held the weights yet
    assert not seeding_over(104.0, 100.0, 5.0, 1, 2)  # its window runs
    assert seeding_over(105.0, 100.0, 5.0, 1, 2)
    assert not seeding_over(200.0, 100.0, 5.0, 1, 0)  # nobody to take over
    assert seeding_over(200.0, 100.0, 5.0, 1, 0, alone=True)  # recalled at once (simulator)
    assert seeding_over(0.1 + 0.7, 0.1, 0.7, 1, 2)  # at seed_start + window_s to the last bit


def test_a_read_splits_by_the_step_of_each_request_deltas_before_releases():
    """Asynchronous RL: a worker's flush carries requests of several steps in flight."""
    mixed = DeltaBatch(
        worker_id="w",
        version=3,
        items=[delta("4:0:0", 0, [5]), delta("3:1:0", 2, [6]), delta("4:0:1", 0, [7])],
        released=[RequestLease(request_id="3:0:0", lease=1)],
        release_reason="swap",
    )
    alone = batch("v", [delta("3:2:0", 0, [8])])
    parts = split_by_step([mixed, alone, batch("x", [delta("bad", 0, [1])])])
    assert sorted(parts) == [-1, 3, 4]
    three = parts[3]
    assert [i.request_id for i in three[0].items] == ["3:1:0"]
    assert [r.request_id for r in three[0].released] == ["3:0:0"]
    assert three[0].version == 3 and three[0].release_reason == "swap"
    assert three[1] is alone  # a batch of one step is passed on as it is
    assert [i.request_id for i in parts[4][0].items] == ["4:0:0", "4:0:1"]
    assert parts[4][0].released == []


def test_deltas_from_a_version_older_than_the_bound_are_not_taken_and_continue_elsewhere():
    t = replace_step(table(n=1, prompts=2, max_new=5), step=2)
    early = DeltaBatch(worker_id="w", version=1, items=[delta("2:0:0", 0, [5, 6])])
    older = DeltaBatch(worker_id="old", version=0, items=[delta("2:0:0", 2, [7])])
    out = apply_held(t, [early, older], CollectRules(max_staleness=1))
    assert t.requests["2:0:0"].token_ids == [5, 6]  # version 1 >= 2 - 1; version 0 is not
    assert t.requests["2:0:0"].version_runs == [(0, 1)]
    assert out.applied["out_of_bound"] == 1
    (job,) = out.released["bound"]  # continued from its 2 tokens under a new lease
    assert job.prefix_ids == [5, 6] and job.lease == 1
    assert out.stale == {"old": {("2:0:0", 0)}}  # the worker that sent them is told to drop it
    assert t.migrations == {"bound": 1}
    # no bound: the same deltas are taken (a synchronous run never checks)
    t2 = replace_step(table(n=1, prompts=2, max_new=5), step=2)
    out2 = apply_held(t2, [early, older], CollectRules())
    assert t2.requests["2:0:0"].token_ids == [5, 6, 7] and "out_of_bound" not in out2.applied


def replace_step(t, step):
    """The test table as a table of `step` (request ids and versions renamed)."""
    return factories.table(len(t.prompts), t.group_size, 5, step=step)

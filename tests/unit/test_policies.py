"""The scheduling policies driven with synthetic timelines."""

import math

import pytest

from services.core.balancer import WorkerLoad, releases
from services.core.plateau import PlateauEstimator
from services.core.seeding import (
    PoolSizer,
    SeedingController,
    pool_target,
    recommended_pool_size,
)
from tests import factories


def test_t_seed_grows_while_the_trainer_waits_and_shrinks_once_it_does_not():
    c = SeedingController(t_seed_s=4.0, eta=2.0, wait_share=0.1)
    assert c.window_s(2) == 4.0
    # the trainer waited 3 s after the window, 1 s is its share of 10 s of compute: seed longer
    assert c.update(2, t_train_wait_s=3.0, t_train_compute_s=10.0) == 5.0
    # it never waited: the window only delayed training: seed shorter, and drop 10% of it (how
    # much too long it was, a wait of 0 cannot say)
    assert c.update(2, t_train_wait_s=0.0, t_train_compute_s=40.0) == 5.0 - 4.0 / 2 - 0.5
    # a step whose trainer waits less as T_seed grows, until it does not wait at all (past
    # that, the window only delays training): T_seed settles where the wait is its share
    c = SeedingController(t_seed_s=0.0, eta=2.0, wait_share=0.05)
    for _ in range(60):
        wait = max(0.0, 30.0 - 0.5 * c.t_seed_s)  # made up: 30 s at T_seed 0, none from 60 s
        c.update(3, wait, t_train_compute_s=100.0)
    assert c.t_seed_s == pytest.approx(50.0, abs=0.5)  # waits 5 s = 5% of 100 s


def test_t_seed_is_bounded_below():
    c = SeedingController(t_seed_s=1.0, eta=1.0, min_seed_s=0.5)
    assert c.update(1, 0.0, 100.0) == 0.5


def test_memory_jumps_to_the_value_of_a_pool_size_seen_before():
    c = SeedingController(t_seed_s=2.0, eta=1.0, wait_share=0.1, backoff=0.0)  # 1 s of 10 s
    c.window_s(4)
    c.update(4, 6.0, 10.0)  # 7.0 worked for 4 instances
    c.window_s(2)
    c.update(2, 0.0, 10.0)  # 6.0 for 2 instances
    assert c.window_s(4) == 7.0
    assert c.window_s(2) == 6.0
    assert c.window_s(2) == 6.0  # same size: no jump, keeps the current value


def test_no_preemptible_worker_means_no_seeding_window():
    c = SeedingController(t_seed_s=2.0)
    assert c.window_s(0) == math.inf
    assert c.update(0, 5.0, 0.0) == 2.0


def test_recommended_pool_size_follows_the_formula():
    assert recommended_pool_size(30.0, 4, 10.0, 2, 20.0) == (30 * 4 + 10 * 2) / 20
    assert recommended_pool_size(1.0, 1, 1.0, 1, 0.0) == math.inf


def test_the_pool_a_scaler_should_hold_is_n_prem_with_headroom():
    assert pool_target(4.0, 1.25) == 5
    assert pool_target(4.1, 1.0) == 5  # rounded up: a fraction of an instance is one instance
    assert pool_target(0.2, 1.25) == 1  # at least one: seeding needs somewhere to hand off
    assert pool_target(math.inf, 1.25) is None  # no step trained yet: hold what the cloud gives


def test_the_pool_follows_the_mean_n_prem_of_the_last_steps():
    sizer = PoolSizer(headroom=1.0, window=3)
    assert sizer.after_step(math.inf) is None  # nothing known yet
    assert sizer.after_step(4.0) == 4
    assert sizer.after_step(6.0) == 5
    assert sizer.after_step(5.5) == 6  # mean 5.17, rounded up
    assert sizer.after_step(2.0) == 5  # 6.0, 5.5, 2.0: the first step has left the window
    assert sizer.after_step(math.inf) == 5  # a step with no training time changes nothing


def test_balancer_releases_exactly_the_surplus():
    loads = [
        WorkerLoad("a", 0, 8),
        WorkerLoad("b", 13, 8),
        WorkerLoad("c", 8, 8),
        WorkerLoad("d", 9, 4),
    ]
    assert releases(loads, queued=0) == {"b": 5, "d": 5}


def test_balancer_does_nothing_when_balanced_or_work_is_queued():
    assert releases([WorkerLoad("a", 0, 8), WorkerLoad("b", 8, 8)], queued=0) == {}
    assert releases([WorkerLoad("a", 0, 8), WorkerLoad("b", 20, 8)], queued=3) == {}
    assert releases([WorkerLoad("a", 2, 8), WorkerLoad("b", 20, 8)], queued=0) == {}
    # "a" holds none of the step's requests, but serves other runs at once that fill it: no
    # room for them, so nothing moves (a release would only churn)
    assert releases([WorkerLoad("a", 0, 0), WorkerLoad("b", 20, 8)], queued=0) == {}


def test_a_worker_serving_several_runs_has_room_for_one_beside_the_others():
    from services.contracts.messages import RunLoad
    from services.core.step_controller import room_for_run

    runs = {"a": RunLoad(version=1, active=40), "b": RunLoad(version=1, active=88)}
    shared = factories.beat("w", run_id="a", version=1, active=128, slots=128, runs=runs)
    single = factories.beat("w", run_id="a", version=1, active=40, slots=128)
    assert room_for_run(shared, shared.serving("a")) == 40  # 128 less b's 88
    assert room_for_run(shared, shared.serving("b")) == 88
    assert room_for_run(single, single) == 128


def test_equal_caps_even_the_workers_out_below_their_plateaus():
    from services.core.balancer import equal_caps

    loads = [WorkerLoad("a", 0, 64), WorkerLoad("b", 30, 64), WorkerLoad("c", 3, 2)]
    capped = equal_caps(loads)
    assert [w.plateau for w in capped] == [11, 11, 2]  # ceil(33 / 3), never above the plateau
    assert releases(capped, queued=0) == {"b": 19, "c": 1}


def test_plateau_is_where_throughput_stops_growing():
    est = PlateauEstimator(max_batch=64)
    assert est.plateau() == 64  # nothing known yet
    for batch, tok_s in ((1, 100), (2, 200), (4, 390), (8, 700), (16, 760), (32, 770)):
        for _ in range(3):
            est.record(batch, tokens=batch, seconds=batch / tok_s)
    assert est.plateau() == 64  # best is at the largest size tried (32 < 64): still growing
    for _ in range(3):
        est.record(64, tokens=64, seconds=64 / 760)
    assert est.plateau() == 8  # 700 >= 0.9 * 770


def test_plateau_found_when_the_curve_saturates_at_the_largest_batch():
    est = PlateauEstimator(max_batch=16)
    for batch in (2, 4, 8, 16):
        tok_s = 1000 * batch / (10 + 10 * batch)  # step cost grows with the batch
        for _ in range(3):
            est.record(batch, tokens=batch, seconds=batch / tok_s)
    assert est.plateau() == 8  # 88.9 tok/s >= 0.9 * 94.1


def test_fair_share_splits_the_queue_evenly():
    from services.core.balancer import fair_share

    assert fair_share(1024, 8) == 128
    assert fair_share(10, 4) == 3
    assert fair_share(5, 0) == 0

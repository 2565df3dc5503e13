"""core.step_controller: one step's seeding window, recall, read cap and balancing decided from
heartbeats, counts and a clock, with no Redis (the shell is `coordinator/scheduling.py`)."""

import functools
import math

from services.contracts.messages import DeltaBatch, DeltaItem, Heartbeat
from services.core.balancer import ReleaseGate, WorkerLoad
from services.core.step_controller import StepController, balance_orders, route_deltas, serving
from tests import factories
from tests.conftest import granted_batch

RUN, STEP = "run", 2


beat = functools.partial(factories.beat, version=STEP, run_id=RUN)


def control(window_s: float = 5.0, fair_reads: bool = True) -> StepController:
    """A step's controller whose step opens (`start`) at 0 with a window of `window_s`."""
    table = factories.table(8, 2, 4, run_id=RUN, step=STEP, seed=1)
    return StepController(table, fair_reads=fair_reads, window_s=window_s)


def start(c: StepController, workers: dict[str, Heartbeat], seed_done: bool, now: float):
    return c.start(workers, seed_done, c.window_s, 0.0, now)


def actions_of(out) -> list[tuple[str, str]]:
    return [(w, order.action) for w, order in out.orders]


def test_the_window_runs_from_when_a_reserved_worker_holds_the_step_then_it_steps_aside():
    c = control(window_s=5.0)
    beats = {"r-1": beat("r-1", "reserved", version=STEP - 1), "p-1": beat("p-1", "preemptible")}
    assert start(c, beats, seed_done=False, now=0.0).orders == []
    c.tick(1.0, 16, beats, {}, 0)
    assert c.seed_start is None  # still loading the step's weights
    beats["r-1"] = beat("r-1", "reserved")
    c.tick(2.0, 16, beats, {}, 0)
    assert c.seed_start == 2.0 and not c.seeded_out
    out = c.tick(7.0, 16, beats, {}, 0)
    assert actions_of(out) == [("r-1", "pause")] and out.seed_end == 7.0 and c.seeded_out


def test_no_reserved_worker_ends_seeding_at_once_and_a_resumed_step_is_over():
    c = control()
    out = start(c, {"p-1": beat("p-1", "preemptible")}, seed_done=False, now=3.0)
    assert out.seed_end == 3.0 and out.orders == []
    resumed = control()
    assert start(resumed, {}, seed_done=True, now=9.0).seed_end is None
    assert resumed.seeded_out and resumed.seed_end == 0.0


def test_with_no_preemptible_worker_left_the_reserved_pool_is_recalled_once():
    c = control(window_s=math.inf)
    beats = {"r-1": beat("r-1", "reserved", paused=True)}
    c.seeded_out = True
    out = c.tick(1.0, 4, beats, {}, 0)
    assert actions_of(out) == [("r-1", "resume")] and out.recalled and out.resumed == 1
    assert not c.tick(2.0, 4, beats, {}, 0).recalled


def test_read_cap_is_an_equal_share_of_the_unfinished_requests_among_serving_workers():
    beats = {f"p-{i}": beat(f"p-{i}", "preemptible") for i in range(3)}
    beats["r-1"] = beat("r-1", "reserved", paused=True)  # stepped aside: not serving
    assert serving(beats, RUN, STEP) == 3
    c = control()
    c.seeded_out = True
    assert c.tick(0.0, 10, beats, {}, 0).read_cap == 4
    assert control(fair_reads=False).tick(0.0, 10, beats, {}, 0).read_cap is None


def test_an_idle_worker_beside_a_crowded_one_gets_a_release_order_once_per_cooldown():
    c = control()
    c.seeded_out = True
    beats = {"p-1": beat("p-1", "preemptible"), "p-2": beat("p-2", "preemptible")}
    out = c.tick(0.0, 6, beats, {"p-1": 6}, 6)
    assert out.released == {"p-1": 3} and actions_of(out) == [("p-1", "release")]
    assert c.tick(0.5, 6, beats, {"p-1": 6}, 6).released == {}
    assert c.tick(2.0, 6, beats, {"p-1": 6}, 6).released == {"p-1": 3}


def test_balance_orders_without_fair_reads_only_brings_workers_under_their_plateau():
    loads = [WorkerLoad("a", 10, 8), WorkerLoad("b", 0, 8)]
    assert balance_orders(loads, 0, False, ReleaseGate(), 0.0) == ({"a": 2}, [])
    assert balance_orders(loads, 1, False, ReleaseGate(), 0.0) == ({}, [])


def test_finish_without_a_window_closed_ends_seeding_with_no_seed_end():
    c = control(window_s=math.inf)
    out = c.finish(4.0)
    assert out.seed_end == 4.0 and c.seeded_out and c.seed_end is None
    assert c.finish(5.0).seed_end is None


def delta(rid: str, tokens: list[int], finished: bool = False) -> DeltaItem:
    return DeltaItem(
        request_id=rid,
        lease=0,
        grant="",
        offset=0,
        token_ids=tokens,
        logprobs=[0.0] * len(tokens),
        finished=finished,
        finish_reason="stop" if finished else None,
    )


def test_a_read_of_deltas_goes_to_the_controllers_of_its_steps_and_other_steps_are_counted():
    c = control()
    flush = DeltaBatch(
        worker_id="p-1",
        version=STEP,
        items=[delta(f"{STEP}:0:0", [5, 0], finished=True), delta(f"{STEP + 1}:0:0", [7])],
    )
    flush = granted_batch(c.table, flush)
    applied, unknown = route_deltas({STEP: c}, [flush])
    assert unknown == 1  # the next step is not in flight here
    [(into, outcome)] = applied
    assert into is c and outcome.finished == [f"{STEP}:0:0"] and outcome.tokens_appended == 2
    assert c.table.requests[f"{STEP}:0:0"].token_ids == [5, 0]
    again, _ = route_deltas({STEP: c}, [flush])  # the same flush read twice: appended once
    assert again[0][1].tokens_appended == 0

"""core.step_controller: the one decider of a step. Each event (open, a read of deltas, a tick,
the jobs claimed from a dead reader, the end) returns one complete `Effects` value, decided from
heartbeats, counts and a clock, with no Redis (the shell is `coordinator/step/loop.py`)."""

import functools
import math

from services.contracts.messages import DeltaBatch, DeltaItem, Heartbeat, RunLoad
from services.core.balancer import ReleaseGate, WorkerLoad
from services.core.seeding import SeedingController
from services.core.stall import Action, StallTracker
from services.core.step_controller import (
    Lead,
    StepController,
    Tick,
    balance_orders,
    route_deltas,
    serving,
)
from tests import factories
from tests.conftest import granted_batch

RUN, STEP = "run", 2


beat = functools.partial(factories.beat, version=STEP, run_id=RUN)


def control(
    window_s: float = 5.0, fair_reads: bool = True, staleness: int = 0, lead: Lead | None = None
) -> StepController:
    """A leader's step controller whose step opens (`start`) at 0 with a window of
    `window_s`."""
    table = factories.table(8, 2, 4, run_id=RUN, step=STEP, seed=1)
    lead = lead or Lead()
    return StepController(
        table, fair_reads=fair_reads, staleness=staleness, lead=lead, window_s=window_s
    )


def start(c: StepController, workers: dict[str, Heartbeat], seed_done: bool, now: float):
    """The step opened (queued now) with the test's window rather than Algorithm 1's."""
    window = c.window_s
    out = c.open(workers, 0.0, now, queued_at=1.0, seed_done=seed_done)
    c.window_s = window
    return out


def tick(
    c: StepController,
    now: float,
    unfinished: int,
    beats: dict[str, Heartbeat],
    executing: dict[str, int],
    pending: int,
    **over,
):
    """A tick with `unfinished` requests of the step in all (the other shards' the rest)."""
    others = unfinished - c.table.unfinished_count
    return c.tick(Tick(now, now, beats, others, executing, pending, **over))


def actions_of(out) -> list[tuple[str, str]]:
    return [(w, order.action) for w, order in out.orders]


def test_the_window_runs_from_when_a_reserved_worker_holds_the_step_then_it_steps_aside():
    c = control(window_s=5.0)
    beats = {"r-1": beat("r-1", "reserved", version=STEP - 1), "p-1": beat("p-1", "preemptible")}
    assert start(c, beats, seed_done=False, now=0.0).orders == []
    tick(c, 1.0, 16, beats, {}, 0)
    assert c.seed_start is None  # still loading the step's weights
    beats["r-1"] = beat("r-1", "reserved")
    tick(c, 2.0, 16, beats, {}, 0)
    assert c.seed_start == 2.0 and not c.seeded_out
    out = tick(c, 7.0, 16, beats, {}, 0)
    assert actions_of(out) == [("r-1", "pause")] and out.seed_end == 7.0 and c.seeded_out


def test_no_reserved_worker_ends_seeding_at_once_and_a_resumed_step_is_over():
    c = control()
    out = start(c, {"p-1": beat("p-1", "preemptible")}, seed_done=False, now=3.0)
    assert out.seed_end == 3.0 and out.orders == []
    resumed = control()
    opened = start(resumed, {}, seed_done=True, now=9.0)
    assert opened.seed_end is None and len(opened.jobs) == 16 and opened.queued_at == 1.0
    assert resumed.seeded_out and resumed.seed_end == 0.0


def test_with_no_preemptible_worker_left_the_reserved_pool_is_recalled_once():
    c = control(window_s=math.inf)
    beats = {"r-1": beat("r-1", "reserved", paused=True)}
    c.seeded_out = True
    out = tick(c, 1.0, 4, beats, {}, 0)
    assert actions_of(out) == [("r-1", "resume")] and out.recalled and out.resumed == 1
    assert not tick(c, 2.0, 4, beats, {}, 0).recalled


def test_a_reserved_pool_that_starts_aside_with_no_window_never_seeds():
    """The simulator's node trains between steps (`starts_aside`): a zero window (T_seed 0, or
    asynchronous RL) ends seeding at the open, with no order (nobody to pause)."""

    def zero_window(starts_aside: bool) -> StepController:
        table = factories.table(8, 2, 4, run_id=RUN, step=STEP, seed=1)
        lead = Lead(seeding=SeedingController(t_seed_s=0.0))
        return StepController(table, lead=lead, starts_aside=starts_aside)

    c = zero_window(starts_aside=True)
    beats = {
        "r-1": beat("r-1", "reserved", version=STEP - 1, paused=True),
        "p-1": beat("p-1", "preemptible"),
    }
    out = c.open(beats, 0.0, 2.0, queued_at=1.0)
    assert out.seed_end == 2.0 and out.orders == [] and c.seeded_out and c.window_s == 0.0
    plain = zero_window(starts_aside=False)  # the services': it seeds until a tick pauses it
    assert plain.open(beats, 0.0, 2.0, queued_at=1.0).seed_end is None and not plain.seeded_out


def test_a_pool_that_steps_aside_alone_is_recalled_in_the_same_tick_and_balances_nothing():
    """The simulator's rules (`aside_alone`, `balances` off): at its window's end the reserved
    pool steps aside with no preemptible worker left and is called back at once; the tick
    orders no release (the simulator balances through `balance`)."""
    c = control(window_s=5.0)
    c.aside_alone, c.balances = True, False
    beats = {"r-1": beat("r-1", "reserved")}
    start(c, beats, seed_done=False, now=0.0)
    tick(c, 1.0, 16, beats, {}, 0)
    out = tick(c, 6.0, 16, beats, {}, 0)
    assert actions_of(out) == [("r-1", "pause"), ("r-1", "resume")]
    assert out.seed_end == 6.0 and out.recalled
    crowded = {"p-1": beat("p-1", "preemptible"), "p-2": beat("p-2", "preemptible")}
    assert tick(c, 7.0, 6, crowded, {"p-1": 6}, 6).released == {}


def test_read_cap_is_an_equal_share_of_the_unfinished_requests_among_serving_workers():
    beats = {f"p-{i}": beat(f"p-{i}", "preemptible") for i in range(3)}
    beats["r-1"] = beat("r-1", "reserved", paused=True)  # stepped aside: not serving
    assert serving(beats, RUN, STEP) == 3
    c = control()
    c.seeded_out = True
    assert tick(c, 0.0, 10, beats, {}, 0).read_cap == 4
    assert tick(control(fair_reads=False), 0.0, 10, beats, {}, 0).read_cap is None


def test_an_idle_worker_beside_a_crowded_one_gets_a_release_order_once_per_cooldown():
    c = control()
    c.seeded_out = True
    beats = {"p-1": beat("p-1", "preemptible"), "p-2": beat("p-2", "preemptible")}
    out = tick(c, 0.0, 6, beats, {"p-1": 6}, 6)
    assert out.released == {"p-1": 3} and actions_of(out) == [("p-1", "release")]
    assert tick(c, 0.5, 6, beats, {"p-1": 6}, 6).released == {}
    assert tick(c, 2.0, 6, beats, {"p-1": 6}, 6).released == {"p-1": 3}


def test_balance_orders_without_fair_reads_only_brings_workers_under_their_plateau():
    loads = [WorkerLoad("a", 10, 8), WorkerLoad("b", 0, 8)]
    assert balance_orders(loads, 0, False, ReleaseGate(), 0.0) == ({"a": 2}, [])
    assert balance_orders(loads, 1, False, ReleaseGate(), 0.0) == ({}, [])


def test_the_end_without_a_window_closed_ends_seeding_with_no_seed_end():
    c = control(window_s=math.inf)
    out = c.end(4.0, 4.0)
    assert out.seed_end == 4.0 and c.seeded_out and c.seed_end is None
    assert out.times is not None and out.times.seed_end is None and out.times.rollout_end == 4.0
    assert c.end(5.0, 5.0).seed_end is None


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
    [(into, effects)] = applied
    assert into is c and effects.score == [f"{STEP}:0:0"] and effects.read is not None
    assert effects.read.tokens_appended == 2 and effects.rows == {f"{STEP}:0:0"}
    assert c.table.requests[f"{STEP}:0:0"].token_ids == [5, 0]
    assert effects.publish == []  # its group's other response is unfinished
    again, _ = route_deltas({STEP: c}, [flush])  # the same flush read twice: appended once
    assert again[0][1].read is not None and again[0][1].read.tokens_appended == 0


def test_a_group_completed_by_a_read_is_published_once_stored():
    c = control()
    items = [delta(f"{STEP}:0:{i}", [5, 0], finished=True) for i in range(2)]
    flush = granted_batch(c.table, DeltaBatch(worker_id="p-1", version=STEP, items=items))
    effects = c.on_deltas([flush])
    assert effects.publish == [0] and 0 in c.table.pending_groups
    c.on_scores({rid: 1.0 for rid in effects.score})
    c.stored(effects)
    assert 0 not in c.table.pending_groups


def test_one_definition_of_serving_counts_staleness():
    """A reserved worker paused holding a version that may generate the step (s - k .. s)
    does not serve it; under max_staleness a worker on an older version that serves the step
    is balanced like one on the step's own."""
    aside = beat("r-1", "reserved", version=STEP - 1, paused=True)
    assert serving({"r-1": aside}, RUN, STEP) == 1  # paused for an older version: serves
    assert serving({"r-1": aside}, RUN, STEP, staleness=1) == 0
    c = control(staleness=1)
    c.seeded_out = True
    beats = {"p-1": beat("p-1", "preemptible", version=STEP - 1), "p-2": beat("p-2", "preemptible")}
    out = tick(c, 0.0, 6, beats, {"p-1": 6}, 6)
    assert out.released == {"p-1": 3}


def test_a_tick_names_the_dead_readers_to_reclaim_and_the_claimed_jobs_move():
    c = control()
    c.seeded_out = True
    readers = {"w-dead": 2, "w-live": 1, "w-idle": 0}
    out = tick(c, 0.0, 16, {}, {}, 0, readers=readers, beating={"w-live"})
    assert out.reclaim == ["w-dead"]
    job = c.table.job(f"{STEP}:0:0")
    claimed = c.on_claimed("w-dead", [b"1-0"], [job], "coordinator")
    assert [j.request_id for j in claimed.jobs] == [f"{STEP}:0:0"]
    assert claimed.migrated == {"death": 1} and claimed.acks == [b"1-0"]
    assert claimed.drop_reader == "w-dead" and claimed.rows == {f"{STEP}:0:0"}


def test_the_stall_check_is_the_ticks_and_the_end_resumes_the_run():
    lead = Lead(stall=StallTracker(stall_after_s=1.0, timeout_s=10.0))
    c = control(lead=lead)
    c.seeded_out = True
    beats = {"r-1": beat("r-1", "reserved", paused=True)}  # stepped aside: nobody serves
    assert tick(c, 0.0, 16, beats, {}, 0, committed=STEP).stall is None
    out = tick(c, 2.0, 16, beats, {}, 0, committed=STEP)
    assert out.stall is not None and out.stall.action is Action.STALL
    assert tick(c, 3.0, 16, beats, {}, 0, committed=STEP, oldest=False).stall is None
    assert "r-1" in lead.seen
    out = tick(c, 20.0, 16, beats, {}, 0, committed=STEP)
    assert out.fail is not None and "stall_timeout_s" in out.fail
    end = c.end(21.0, 21.0)
    assert end.stall is not None and end.stall.action is Action.RESUME


def test_a_worker_serving_several_runs_counts_for_each_with_that_runs_load():
    """One engine serving two runs (issue 52): each run's step reads the worker as if it
    served that run alone, with that run's version, requests held and pause."""
    both = beat(
        "p-1", version=5, run_id="b", active=6,
        runs={"b": RunLoad(version=5, active=4), RUN: RunLoad(version=STEP, active=2)},
    )  # fmt: skip
    assert serving({"p-1": both}, RUN, STEP) == 1 and serving({"p-1": both}, "b", 5) == 1
    assert serving({"p-1": both}, "c", STEP) == 0
    aside = beat(
        "p-1", version=5, run_id="b", active=6,
        runs={"b": RunLoad(version=5, active=4), RUN: RunLoad(version=STEP, active=2, paused=True)},
    )  # fmt: skip
    assert serving({"p-1": aside}, RUN, STEP) == 0 and serving({"p-1": aside}, "b", 5) == 1
    c = control()
    beats = {"p-1": both, "p-2": beat("p-2", "preemptible")}
    start(c, beats, seed_done=False, now=0.0)
    assert c.pools == {"reserved": 0, "preemptible": 2}
    c.seeded_out = True
    out = tick(c, 0.0, 6, beats, {"p-1": 6}, 6)  # it holds the step's version: balanced
    assert out.released == {"p-1": 3}


def test_a_step_restored_on_another_redis_primary_moves_every_unfinished_request_on():
    """A failover: the new primary may lack the old one's last writes, so every unfinished
    request continues under a new lease (and grant) from the tokens it holds; the finished stay,
    and the step is recorded as written on the new primary."""
    c = control()
    done = c.table.requests["2:0:0"]
    done.token_ids, done.finish_reason = [5, 6], "stop"
    c.table.unfinished_count -= 1
    held = c.table.requests["2:1:0"]
    held.token_ids, grant = [7], held.grant
    out = c.open({}, 0.0, 0.0, primary="10.0.0.2:6379", written_on="10.0.0.1:6379")
    assert out.migrated == {"failover": 15} and out.primary == "10.0.0.2:6379"
    assert {job.request_id for job in out.jobs} == out.rows and "2:0:0" not in out.rows
    assert held.lease == 1 and held.grant != grant
    job = next(j for j in out.jobs if j.request_id == "2:1:0")
    assert job.lease == 1 and job.prefix_ids == [7]
    # restored where it was written, or queued now: nothing moves
    same = control().open({}, 0.0, 0.0, primary="10.0.0.1:6379", written_on="10.0.0.1:6379")
    assert same.migrated == {} and same.jobs == [] and same.primary is None
    queued = control().open({}, 0.0, 0.0, queued_at=1.0, primary="10.0.0.1:6379")
    assert queued.primary == "10.0.0.1:6379" and "failover" not in queued.migrated
    assert control().open({}, 0.0, 0.0, queued_at=1.0).primary is None  # a plain Redis URL

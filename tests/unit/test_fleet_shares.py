"""The fleet's slots among runs (services/core/fleet_shares.py): weighted max-min fairness,
tails first, whole slots that add up, clear errors; the share error a window is judged by; the
placement of workers; and the runs' demands as the placer reads them (workers/placement.py)."""

import random

import pytest

from services.contracts.messages import Heartbeat, RunLoad
from services.coordinator.workers.placement import claims_of, held_floor, parse_demand
from services.core.fleet_shares import (
    ClaimError,
    FleetWorker,
    RunClaim,
    allot,
    place,
    share_error,
    worker_part,
)
from tests import factories


def worker(worker_id: str, holds: str | None, slots: int = 16) -> FleetWorker:
    return FleetWorker(worker_id=worker_id, slots=slots, holds=holds)


def claim(run_id: str, wanted: int, share: float = 1.0, tail: bool = False) -> RunClaim:
    return RunClaim(run_id=run_id, share=share, wanted=wanted, tail=tail)


def test_equal_shares_split_the_fleet_equally():
    got = allot(64, [claim("a", 100), claim("b", 100), claim("c", 100), claim("d", 100)])
    assert got == {"a": 16, "b": 16, "c": 16, "d": 16}


def test_weights_split_it_by_weight():
    assert allot(60, [claim("a", 100, share=2), claim("b", 100, share=1)]) == {"a": 40, "b": 20}


def test_what_a_run_does_not_want_goes_to_the_others_by_weight():
    # a wants 5 of its 20: the 15 it leaves go to b and c, 2:1
    got = allot(60, [claim("a", 5), claim("b", 100, share=2), claim("c", 100)])
    assert got == {"a": 5, "b": 37, "c": 18}


def test_a_run_with_nothing_waiting_gets_nothing_and_idles_nothing():
    assert allot(32, [claim("a", 0), claim("b", 100)]) == {"a": 0, "b": 32}


def test_a_fleet_larger_than_the_demand_gives_every_run_all_it_wants():
    assert allot(100, [claim("a", 7), claim("b", 30, share=5)]) == {"a": 7, "b": 30}


def test_a_tail_comes_first():
    # b's step waits on its last 3 requests: they get slots even though a's share would take all
    got = allot(8, [claim("a", 100, share=10), claim("b", 3, tail=True)])
    assert got == {"a": 5, "b": 3}


def test_tails_wanting_more_than_the_fleet_share_it_by_weight():
    got = allot(9, [claim("a", 50, tail=True, share=2), claim("b", 50, tail=True), claim("c", 9)])
    assert got == {"a": 6, "b": 3, "c": 0}


def test_whole_slots_go_to_the_largest_fractions_then_to_the_first_listed():
    assert allot(10, [claim("a", 9), claim("b", 9), claim("c", 9)]) == {"a": 4, "b": 3, "c": 3}
    assert allot(0, [claim("a", 9)]) == {"a": 0}


def test_every_allotment_adds_up_stays_within_wants_and_is_max_min_fair():
    rng = random.Random(7)
    for _ in range(2000):
        claims = [
            claim(f"r{i}", rng.choice([0, 1, 3, 10, 50, 200]), rng.choice([0.5, 1, 2, 3]))
            for i in range(rng.randint(1, 6))
        ]
        capacity = rng.randint(0, 120)
        got = allot(capacity, claims)
        assert set(got) == {c.run_id for c in claims}
        assert sum(got.values()) == min(capacity, sum(c.wanted for c in claims))
        assert all(0 <= got[c.run_id] <= c.wanted for c in claims)
        # max-min: a run short of its want holds, per unit of share, no less than any other
        # run holds (within one whole slot each)
        short = [c for c in claims if got[c.run_id] < c.wanted]
        for s in short:
            for o in claims:
                assert (got[s.run_id] + 1) / s.share >= (got[o.run_id] - 1) / o.share, (
                    capacity,
                    claims,
                    got,
                )


@pytest.mark.parametrize(
    ("capacity", "claims", "message"),
    [
        (-1, [claim("a", 1)], "capacity must be >= 0"),
        (8, [claim("a", 1, share=0)], "run a: share must be a positive number"),
        (8, [claim("a", 1, share=float("nan"))], "share must be a positive number"),
        (8, [claim("a", -1)], "run a: wanted must be >= 0"),
        (8, [claim("a", 1), claim("a", 2)], "run a claims twice"),
    ],
)
def test_a_claim_that_cannot_be_allotted_is_refused_with_its_cause(capacity, claims, message):
    with pytest.raises(ClaimError, match=message):
        allot(capacity, claims)


def test_share_error_is_the_largest_gap_between_allotted_and_used_fractions():
    assert share_error({"a": 10, "b": 10}, {"a": 10, "b": 10}) == 0
    assert share_error({"a": 10, "b": 10}, {"a": 6, "b": 4}) == pytest.approx(0.1)
    # a run that used slots it was not allotted counts too
    assert share_error({"a": 10}, {"a": 5, "b": 5}) == pytest.approx(0.5)
    assert share_error({}, {}) == 0


def test_workers_stay_on_the_model_they_hold_while_it_is_needed():
    workers = [worker("w1", "base-a"), worker("w2", "base-a"), worker("w3", "base-b")]
    assert place(workers, {"base-a": 32, "base-b": 16}) == {
        "w1": "base-a",
        "w2": "base-a",
        "w3": "base-b",
    }


def test_a_worker_switches_when_another_model_is_short_by_half_a_worker_or_more():
    workers = [worker("w1", "base-a"), worker("w2", "base-a"), worker("w3", "base-b")]
    # base-a needs one worker's slots, base-b two: one of base-a's switches
    got = place(workers, {"base-a": 16, "base-b": 32})
    assert sorted(got.values()) == ["base-a", "base-b", "base-b"] and got["w3"] == "base-b"
    # short by 7 of 16: not worth a load; the spare worker keeps its model and idles
    assert place(workers, {"base-a": 16, "base-b": 23}) == {
        "w1": "base-a",
        "w2": "base-a",
        "w3": "base-b",
    }


def test_where_loads_take_a_moment_a_worker_its_run_does_not_need_serves_any_shortfall():
    workers = [worker("w1", "base-a"), worker("w2", "base-a"), worker("w3", "base-b")]
    # short by 7 of 16: with switch_share 0 the spare worker goes rather than idle
    got = place(workers, {"base-a": 16, "base-b": 23}, switch_share=0)
    assert sorted(got.values()) == ["base-a", "base-b", "base-b"] and got["w3"] == "base-b"
    # one worker, three runs short by a third of it each: it serves one rather than idle
    assert place([worker("w1", "run-a")], {"run-a": 0, "run-b": 6, "run-c": 5}, 0) == {
        "w1": "run-b"
    }
    assert place([worker("w1", "run-a")], {"run-a": 0, "run-b": 6, "run-c": 5}) == {
        "w1": "run-a"  # by half a worker: it idles
    }
    # a worker its run still needs stays, whatever switch_share says
    assert place([worker("w1", "run-a")], {"run-a": 1, "run-b": 16}, 0) == {"w1": "run-a"}
    with pytest.raises(ClaimError, match="switch_share"):
        place(workers, {}, switch_share=1.5)


def beat(worker_id: str, run_id: str | None, active: int) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id, pool="preemptible", run_id=run_id, version=0, active=active,
        slots=16, tokens_generated=0, at=0.0,
    )  # fmt: skip


def test_a_run_wants_at_least_what_its_workers_hold_now():
    """A step's end says 0 and its next step's first tick comes after its workers read it: a
    worker holding a run's requests keeps them, whatever the demand said last."""
    beats = {"w1": beat("w1", "a", 12), "w2": beat("w2", "a", 3), "w3": beat("w3", "b", 0)}
    got = held_floor([claim("a", 0), claim("b", 5), claim("c", 7)], beats)
    assert got == [claim("a", 15), claim("b", 5), claim("c", 7)]


def test_a_worker_serving_several_runs_holds_each_runs_own_requests():
    runs = {"a": RunLoad(version=3, active=2), "b": RunLoad(version=5, active=4)}
    both = factories.beat("w1", version=3, run_id="a", active=6, runs=runs)
    got = held_floor([claim("a", 0), claim("b", 1), claim("c", 0)], {"w1": both})
    assert got == [claim("a", 2), claim("b", 4), claim("c", 0)]


def test_an_empty_engine_loads_whatever_is_short_and_is_placed_first():
    workers = [worker("w1", "base-a"), worker("new", None)]
    assert place(workers, {"base-a": 16, "base-b": 3}) == {"w1": "base-a", "new": "base-b"}
    # nothing short: it stays empty
    assert place([worker("new", None)], {"base-a": 0}) == {"new": None}


def test_every_model_short_of_slots_keeps_a_worker_it_has():
    # base-a needs 2 slots, base-b 30: base-a keeps its worker rather than starve its runs
    workers = [worker("w1", "base-a"), worker("w2", None)]
    assert place(workers, {"base-a": 2, "base-b": 30}) == {"w1": "base-a", "w2": "base-b"}


def test_placement_covers_every_need_the_fleet_can_and_oversupplies_none_by_a_worker():
    rng = random.Random(11)
    models = ["m0", "m1", "m2"]
    for _ in range(1000):
        workers = [
            worker(f"w{i}", rng.choice([None, *models]), slots=rng.choice([4, 8, 16]))
            for i in range(rng.randint(1, 8))
        ]
        need = {m: rng.choice([0, 2, 8, 16, 40]) for m in models}
        got = place(workers, need)
        assert set(got) == {w.worker_id for w in workers}
        held = {m: sum(w.slots for w in workers if got[w.worker_id] == m) for m in models}
        moved = [w for w in workers if got[w.worker_id] != w.holds]
        assert all(got[w.worker_id] is not None for w in moved)
        for m in models:  # switches only while the model needed them: never over by a worker
            movers = [w.slots for w in moved if got[w.worker_id] == m]
            if movers:
                assert held[m] - need[m] < max(movers), (workers, need, got)
        # a model short by half its workers' size or more has no idle worker that could go
        idle = [w for w in workers if got[w.worker_id] not in need or need[got[w.worker_id]] == 0]
        for m in models:
            if idle and need[m] - held[m] > 0:
                assert all(
                    w.holds is not None and 2 * (need[m] - held[m]) < w.slots for w in idle
                ), (workers, need, got)


def test_a_demand_is_read_as_its_step_loop_wrote_it_and_anything_else_as_none():
    assert parse_demand(b"12 0 2.0") == (12, False, 2.0)
    assert parse_demand(b"3 1 1.0") == (3, True, 1.0)
    for raw in (None, b"", b"x 1 1.0", b"3 1", b"3 1 0", b"3 1 nan", b"3 1 1e9"):
        assert parse_demand(raw) == (0, False, 1.0), raw
    claims = claims_of(["a", "b"], [b"12 0 2.0", None])
    assert claims == [RunClaim("a", 2.0, 12, False), RunClaim("b", 1.0, 0, False)]


def test_a_workers_part_of_a_run_covers_its_allotment():
    """A worker serving several runs at once reads at most its part of each run's allotment:
    the run's share of the fleet's slots, of the worker's own, rounded up."""
    assert worker_part(64, 256, 128) == 32
    assert worker_part(65, 256, 128) == 33  # rounded up: the parts cover the allotment
    assert sum(worker_part(10, 24, s) for s in (8, 8, 8)) >= 10
    assert worker_part(0, 256, 128) == 0  # nothing allotted: nothing read
    assert worker_part(300, 256, 128) == 128  # never more than its slots
    assert worker_part(5, 0, 16) == 16  # no fleet known: its own slots
    # its weight among the runs the worker serves is its part at least
    assert worker_part(0, 256, 128, floor=0.25) == 32
    assert worker_part(128, 256, 128, floor=0.25) == 64

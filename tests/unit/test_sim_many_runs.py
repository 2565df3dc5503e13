"""Several runs on one trace (services/sim/shared_pool.py): one run on the shared pool is the plain
simulation, the trace's split, the placement's switches, token conservation across them, and
determinism; a pool whose instances serve every run at once (LoRA runs on one base,
services/sim/lanes.py): one batch that costs what one engine's does, no switch, each run's part
of an instance; staggered starts in both setups."""

import json
import math

import pytest

from services.sim.engine import SimEngine
from services.sim.lanes import OneBatch, new_worker
from services.sim.shared_pool import (
    MANY_RUNS_SYSTEMS,
    ManyRuns,
    SharedPool,
    compare_many_runs,
    run_seed,
    split_targets,
)
from tests.unit.test_simulator import CHURN, small_scenario

HORIZON_S = 600.0
ADAPTER_SHARE = 0.004  # a LoRA version's bytes over the model's (docs/simulation.md)
ASYNC = MANY_RUNS_SYSTEMS["hybrid-async-k1-all-spot"]


def lora_scenario():
    return small_scenario().with_lora(ADAPTER_SHARE)


def scaled(runs: int) -> list[tuple[float, int]]:
    """The churning trace with `runs` times its instances."""
    return [(t, n * runs) for t, n in CHURN]


def test_split_gives_instance_i_to_deployment_i_mod_k():
    parts = split_targets([(0.0, 10), (5.0, 3), (9.0, 0)], 4)
    assert [[n for _, n in part] for part in parts] == [[3, 1, 0], [3, 1, 0], [2, 1, 0], [2, 0, 0]]
    assert all(sum(p[i][1] for p in parts) == n for i, (_, n) in enumerate([(0, 10), (5, 3)]))


def test_one_run_shared_is_the_plain_simulation():
    out = compare_many_runs(small_scenario(), CHURN, ManyRuns(runs=1), 3, HORIZON_S)
    assert out["shared"]["tokens_trained"] > 0 and out["shared"]["preemptions"] > 0
    assert out["shared"]["switches"] == 0
    assert_equal_but_pool_counts(out)


def assert_equal_but_pool_counts(out: dict) -> None:
    pool_only = ("switch_pull_s", "preempted_unplaced", "several_runs_frac")  # the pool's own
    shared = {k: v for k, v in out["shared"].items() if k not in pool_only}
    assert json.dumps(shared, sort_keys=True) == json.dumps(out["separate"], sort_keys=True)


@pytest.mark.parametrize("system", [MANY_RUNS_SYSTEMS["hybrid-all-spot"], ASYNC])
def test_one_run_served_with_the_others_is_the_plain_simulation(system):
    """Serving every run at once, one run is a plain instance's: its lane is the engine."""
    many = ManyRuns(runs=1, serve="all", system=system)
    out = compare_many_runs(lora_scenario(), CHURN, many, 3, HORIZON_S)
    assert out["shared"]["tokens_trained"] > 0 and out["shared"]["preemptions"] > 0
    assert out["shared"]["several_runs_frac"] == 0.0
    assert_equal_but_pool_counts(out)


def run_shared(runs: int, **setup) -> SharedPool:
    # 16 slots a worker as placement sees them: the small steps (64 requests) then need
    # several workers, so that instances move between runs
    many = ManyRuns(runs=runs, slots=setup.pop("slots", 16), **setup)
    sc = lora_scenario() if many.serve == "all" else small_scenario()
    return SharedPool(sc, many, scaled(runs), 3, HORIZON_S).run()


SETUPS = {
    "release": {"leave": "release"},
    "drain": {"leave": "drain"},
    "all": {"serve": "all"},
    "all, staggered": {"serve": "all", "stagger_s": 20.0},
    "all, async": {"serve": "all", "system": ASYNC},
}


@pytest.mark.parametrize("setup", SETUPS.values(), ids=SETUPS.keys())
def test_every_token_and_every_step_exact(setup):
    pool = run_shared(3, **setup)
    serve_all = setup.get("serve") == "all"
    assert (pool.counts.switches == 0) if serve_all else (pool.counts.switches > 0)
    for r, sim in enumerate(pool.sims):
        t = sim.totals
        in_flight = sum(
            len(req.token_ids) for st in sim.inflight.values() for req in st.table.requests.values()
        )
        running = sum(1 for i in sim.fleet.instances.values() if i.engine.running)
        assert running or t.generated == t.trained + t.lost + in_flight
        assert t.generated >= t.trained + t.lost
        work = sim.sc.workload
        assert sim.records, f"run {r} committed no step"
        assert [rec.tokens for rec in sim.records] == [
            work.step(run_seed(3, r), rec.step).total_response_tokens for rec in sim.records
        ]
        assert sim.records[0].start_s == r * setup.get("stagger_s", 0.0)
    names = [n for sim in pool.sims for n, i in sim.fleet.instances.items() if i.pool != "reserved"]
    if serve_all:  # every instance is in every run's instances, once (a lane each)
        assert sorted(names) == sorted(list(pool.pool) * len(pool.sims))
    else:  # an instance serves one run at a time: it is in one run's instances, never two
        assert len(names) == len(set(names))


def test_serving_all_batches_several_runs_in_one_step_and_never_pulls_whole_weights():
    pool = run_shared(3, serve="all")
    out = compare_many_runs(lora_scenario(), scaled(3), ManyRuns(runs=3, serve="all"), 3, HORIZON_S)
    assert out["shared"]["switches"] == 0 and out["shared"]["several_runs_frac"] > 0.2
    # every pull moves an adapter, and a booted worker's first pull the base too: at most one
    # base a worker, never another run's whole weights
    weights = lora_scenario().transfer.weight_bytes
    pulls = sum(sim.totals.pulls for sim in pool.sims)
    pulled = sum(sim.totals.pulled_bytes for sim in pool.sims)
    bases = (pulled - pulls * ADAPTER_SHARE * weights) / weights
    assert math.isclose(bases, round(bases), abs_tol=1e-6) and 0 < round(bases) <= len(pool.pool)


def test_same_seed_same_result():
    a, b = run_shared(2), run_shared(2)
    assert a.counts == b.counts
    assert [s.totals for s in a.sims] == [s.totals for s in b.sims]
    assert [s.records for s in a.sims] == [s.records for s in b.sims]


def test_many_runs_rejects_no_run_and_serving_all_without_lora():
    with pytest.raises(ValueError, match="runs"):
        ManyRuns(runs=0)
    with pytest.raises(ValueError, match="LoRA"):
        SharedPool(small_scenario(), ManyRuns(runs=2, serve="all"), CHURN, 3, HORIZON_S)


def jobs(engine: SimEngine, run: int, count: int, now: float = 0.0) -> None:
    """`count` requests of 1,000 + 100 i context, 200 + 50 i tokens to generate."""
    for i in range(count):
        engine.add(f"0:{i}:0", 1, 1000 + 100 * i + run, 0, 200 + 50 * i + 7 * run, now)


def test_one_batch_of_several_runs_costs_what_one_engine_of_all_its_requests_costs():
    """Two runs' requests in one batch run at the rate, and stop when, one engine holding
    them all would (the same request ids in each run: each lane holds its own)."""
    profile = lora_scenario().spot_engine
    worker = new_worker(0, profile, None, 5.0, 0.0, runs=2)
    one = SimEngine(profile)
    for run, lane in enumerate(worker.lanes):
        jobs(lane.engine, run, 40)
        for i in range(40):
            one.add(f"{run}/0:{i}:0", 1, 1000 + 100 * i + run, 0, 200 + 50 * i + 7 * run, 0.0)
    shared = worker.engine
    assert isinstance(shared, OneBatch) and shared.batch == one.batch == 80
    assert shared.stall_until == one.stall_until  # every prefill queued on one engine
    assert math.isclose(shared.rate(), one.rate(), rel_tol=1e-12)
    first_stop_s = min(lane.engine.next_stop_s(0.0) for lane in worker.lanes)
    assert math.isclose(first_stop_s, one.next_stop_s(0.0), rel_tol=1e-12)
    t = first_stop_s + 2.0
    shared.advance(0.0, t)
    for lane in worker.lanes:
        lane.engine.advance(0.0, t)
    shared.thaw()
    one.advance(0.0, t)
    assert math.isclose(shared.tokens, one.tokens, rel_tol=1e-12)
    assert shared.busy_s == one.busy_s == t and shared.several_s == t
    stopped = {f"{r}/{rid}" for r, lane in enumerate(worker.lanes) for rid in lane.engine.stopped()}
    assert stopped == set(one.stopped()) and stopped


def test_a_lane_reads_up_to_its_part_beside_the_other_runs():
    profile = lora_scenario().spot_engine  # 256 slots
    worker = new_worker(0, profile, None, 5.0, 0.0, runs=2)
    a, b = worker.lanes
    assert a.slots() == b.slots() == 256  # no allotment yet: the worker's room
    jobs(a.engine, 0, 200)
    assert a.slots() == 256 and b.slots() == 56  # the worker's room beside run 0's 200
    a.part, b.part = 100, 128
    assert a.slots() == 100 and b.slots() == 56
    jobs(b.engine, 1, 56)
    assert b.slots() == 56 and worker.engine.batch == 256


def opened_without_spot(pool: SharedPool) -> int:
    """Steps (after each run's first) that opened with no spot worker on their run."""
    return sum(1 for sim in pool.sims for rec in sim.records[1:] if rec.spot_instances == 0)


def test_placing_at_commit_opens_steps_with_workers_and_idles_less_than_separate():
    """Placed only every second, a step opens while its run's workers serve the others: no
    spot worker, so its reserved node generates the whole step. Placed at the commit too, the
    step opens with workers, and the shared pool idles less than the separate ones."""
    assert opened_without_spot(run_shared(3)) > opened_without_spot(
        run_shared(3, place_at_commit=True)
    )
    many = ManyRuns(runs=3, slots=16, place_at_commit=True)
    out = compare_many_runs(small_scenario(), scaled(3), many, 3, HORIZON_S)
    shared, separate = out["shared"], out["separate"]
    assert shared["switches"] > 0
    assert shared["pool_idle_frac"] < separate["pool_idle_frac"]
    assert shared["tokens_per_dollar"] >= separate["tokens_per_dollar"]


def test_cli_prints_the_json_last_and_refuses_bad_input(tmp_path, capsys):
    from bench.sim_many_runs import main

    assert main(["--trace", str(tmp_path / "missing.csv")]) == 2
    trace = tmp_path / "trace.csv"
    trace.write_text("seconds,available\n0,4\n3600,4\n")
    bad_args = (["--runs", "0"], ["--slots", "many"], ["--hours", "0"], ["--stagger-s", "-1"])
    for bad in bad_args:
        with pytest.raises(SystemExit):
            main(["--trace", str(trace), *bad])
    capsys.readouterr()
    assert main(["--trace", str(trace), "--hours", "0.03", "--runs", "2", "--slots", "8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["runs"] == 2 and result["slots"] == 8
    for setup in ("shared", "separate"):
        assert {"pool_idle_frac", "tokens_per_dollar", "mean_step_s", "switches"} <= set(
            result[setup]
        )
    args = ["--hours", "0.03", "--runs", "2", "--serve", "all", "--stagger-s", "30"]
    assert main(["--trace", str(trace), *args, "--system", ASYNC.name]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["serve"] == "all" and result["adapter_share"] > 0 and result["stagger_s"] == 30
    assert result["shared"]["first_step_s"] == result["separate"]["first_step_s"] == [0.0, 30.0]

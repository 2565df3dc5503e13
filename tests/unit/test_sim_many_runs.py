"""Several runs on one trace (services/sim/shared_pool.py): one run on the shared pool is the plain
simulation, the trace's split, the placement's switches, token conservation across them, and
determinism."""

import json

import pytest

from services.sim.shared_pool import (
    ManyRuns,
    SharedPool,
    compare_many_runs,
    run_seed,
    split_targets,
)
from tests.unit.test_simulator import CHURN, small_scenario

HORIZON_S = 600.0


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
    pool_only = ("switch_pull_s", "preempted_unplaced")  # the shared pool's own counts
    shared = {k: v for k, v in out["shared"].items() if k not in pool_only}
    assert json.dumps(shared, sort_keys=True) == json.dumps(out["separate"], sort_keys=True)


def run_shared(runs: int, **setup) -> SharedPool:
    # 16 slots a worker as placement sees them: the small steps (64 requests) then need
    # several workers, so that instances move between runs
    many = ManyRuns(runs=runs, slots=setup.pop("slots", 16), **setup)
    return SharedPool(small_scenario(), many, scaled(runs), 3, HORIZON_S).run()


@pytest.mark.parametrize("leave", ["release", "drain"])
def test_switches_keep_every_token_and_every_step_exact(leave):
    pool = run_shared(3, leave=leave)
    assert pool.counts.switches > 0
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
    # an instance serves one run at a time: it is in one run's instances, never two
    names = [n for sim in pool.sims for n, i in sim.fleet.instances.items() if i.pool != "reserved"]
    assert len(names) == len(set(names))


def test_same_seed_same_result():
    a, b = run_shared(2), run_shared(2)
    assert a.counts == b.counts
    assert [s.totals for s in a.sims] == [s.totals for s in b.sims]
    assert [s.records for s in a.sims] == [s.records for s in b.sims]


def test_many_runs_rejects_no_run():
    with pytest.raises(ValueError, match="runs"):
        ManyRuns(runs=0)


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
    for bad in (["--runs", "0"], ["--slots", "many"], ["--hours", "0"]):
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

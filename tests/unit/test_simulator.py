"""The trace-driven simulator (services/sim): determinism, token accounting, and agreement of
the hybrid with reserved-only when no spot instance is ever there."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from services.sim.compare import compare, summarize
from services.sim.engine import SimEngine
from services.sim.profile import QWEN3_14B, EngineProfile, roofline
from services.sim.scenario import paper_14b
from services.sim.simulation import Simulation
from services.sim.systems import (
    HYBRID,
    HYBRID_ALL_SPOT,
    HYBRID_NO_MIGRATION,
    HYBRID_PLATEAU_READS,
    RESERVED_ONLY,
)

DATA = Path(__file__).resolve().parents[1] / "data"
CHURN = [(15.0 * t, n) for t, n in enumerate([4, 2, 4, 1, 3, 0, 4, 2, 4, 3] * 8)]


def small_scenario(**cloud):
    """The 14B profiles on a small batch of short responses: seconds of CPU per run."""
    sc = paper_14b().with_workload(
        prompts_per_step=16, group_size=4, median_response_tokens=600, max_response_tokens=2048
    )
    # steps of ~50 s: a first window of 30 s (the 14B default) would seed a whole rollout
    return replace(sc, initial_t_seed_s=5.0, cloud=replace(sc.cloud, startup_s=20.0, **cloud))


def run(system, targets, steps=8, **cloud):
    return Simulation(small_scenario(**cloud), system, targets, seed=3, max_steps=steps).run()


@pytest.mark.slow  # ~13 s of simulation: in `make test`, not in `make test-fast`
def test_same_seed_same_result_and_another_seed_differs():
    a = compare(small_scenario(), CHURN, horizon_s=600, seed=1).result()
    b = compare(small_scenario(), CHURN, horizon_s=600, seed=1).result()
    c = compare(small_scenario(), CHURN, horizon_s=600, seed=2).result()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a["systems"]["hybrid"] != c["systems"]["hybrid"]


PLATEAU_NO_MIGRATION = replace(HYBRID_NO_MIGRATION, fair_reads=False)  # the first take all


@pytest.mark.parametrize(
    "system",
    [HYBRID, HYBRID_ALL_SPOT, HYBRID_PLATEAU_READS, HYBRID_NO_MIGRATION, PLATEAU_NO_MIGRATION],
)
@pytest.mark.parametrize("notice_s", [0.0, 30.0])
def test_tokens_generated_equal_trained_plus_lost(system, notice_s):
    sim = run(system, CHURN, notice_s=notice_s)
    t = sim.totals
    assert t.preemptions > 0 and len(sim.records) == 8
    assert t.generated == t.trained + t.lost
    # Every step trains exactly the responses its workload drew: B groups of n, full length.
    work = sim.sc.workload
    assert [r.tokens for r in sim.records] == [
        work.step(3, r.step).total_response_tokens for r in sim.records
    ]
    if system.migration and notice_s > 0:
        assert t.lost == 0  # a notice flushes everything, and migration keeps it
    if system.migration:
        assert t.discarded == 0
    if system == HYBRID_ALL_SPOT and notice_s == 0:  # (the hybrid holds fewer: less churn)
        assert t.lost_unflushed > 0  # killed mid-flush: the tokens after the last flush
    if system == HYBRID_NO_MIGRATION:
        assert t.discarded > 0  # preempted responses restarted from zero


def test_hybrid_without_spot_equals_reserved_only():
    hybrid = summarize(run(HYBRID, [(0.0, 0)], steps=6))
    reserved = summarize(run(RESERVED_ONLY, [], steps=6))
    assert hybrid["mean_pool_instances"] == 0
    assert hybrid["throughput_tok_s"] == pytest.approx(reserved["throughput_tok_s"], rel=0.03)
    assert hybrid["tokens_per_dollar"] == pytest.approx(reserved["tokens_per_dollar"], rel=0.03)


def test_seeding_window_adapts_with_spot_instances():
    sim = run(HYBRID, [(0.0, 4)], steps=8)
    windows = [r.t_seed_s for r in sim.records]
    assert math.isinf(windows[0])  # step 0: no spot instance registered yet: co-located
    assert len({round(w, 3) for w in windows[1:]}) > 2  # Algorithm 1 moves T_seed every step
    assert sim.totals.migrations.get("seed", 0) > 0


@pytest.mark.slow  # ~13 s of simulation: in `make test`, not in `make test-fast`
def test_spot_instances_speed_up_and_cost_is_billed():
    out = compare(small_scenario(), [(0.0, 4)], horizon_s=1800, seed=0).result()
    systems = out["systems"]
    assert systems["hybrid"]["throughput_tok_s"] > systems["reserved-only"]["throughput_tok_s"]
    spot = small_scenario().cloud.spot_instance_per_h
    assert systems["hybrid"]["cost_per_h"] == pytest.approx(83.79 + 4 * spot, rel=0.02)
    assert systems["reserved-x2"]["cost_per_h"] == pytest.approx(2 * 83.79)
    assert 1 <= out["disagg_bal_instances"] <= 16


def test_engine_runs_requests_in_lockstep_and_slows_past_kv_capacity():
    profile = roofline(QWEN3_14B)
    engine = SimEngine(profile)
    engine.add("a", 0, context=100, offset=0, tokens=10, now=0.0)
    engine.add("b", 0, context=100, offset=0, tokens=30, now=0.0)
    t = engine.next_stop_s(0.0)
    assert t == pytest.approx(2 * profile.prefill_s(100) + 10 * profile.step_s(2, 105), rel=0.01)
    engine.advance(0.0, t)
    assert engine.stopped() == ["a"]
    run, tokens = engine.remove("b")
    assert tokens == 10 and run.offset == 0
    tight = profile.with_kv_capacity(1000)
    crowded = SimEngine(tight)
    for i in range(4):
        crowded.add(str(i), 0, context=500, offset=0, tokens=10, now=0.0)
    assert crowded.rate() == pytest.approx(0.5 / tight.step_s(2, 500))


def test_profile_round_trips_and_refuses_bad_files(tmp_path):
    profile = roofline(QWEN3_14B)
    assert profile.step_s(100, 3000) == pytest.approx(
        profile.step_s(64, 3000) + 36 * (profile.step_s(128, 3000) - profile.step_s(64, 3000)) / 64
    )
    path = tmp_path / "p.json"
    profile.save(path)
    assert EngineProfile.load(path) == profile
    path.write_text(json.dumps({"name": "x", "batch": [1, 2], "context": [1, 2]}))
    with pytest.raises(ValueError, match="not an engine profile"):
        EngineProfile.load(path)


@pytest.mark.slow
def test_cli_prints_the_comparison_as_its_last_line(capsys, tmp_path):
    from bench.simulate import main

    trace = DATA / "aws-g4dn-xlarge-us-east-1c-2020-11-20.csv"
    png = tmp_path / "t.png"
    args = ["--trace", str(trace), "--hours", "0.5", "--start-hours", "6", "--plot", str(png)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("reserved-only", "reserved-x2", "disagg-bal", "hybrid", "hybrid-no-seeding"):
        assert set(result["systems"][name]) >= {
            "throughput_tok_s",
            "tokens_per_dollar",
            "mean_step_s",
        }
    for key in (
        "hybrid_vs_reserved_throughput",
        "hybrid_vs_reserved_cost_efficiency",
        "seeding_gain",
    ):
        assert result[key] > 0
    assert png.stat().st_size > 10_000
    assert main(["--trace", str(tmp_path / "missing.csv")]) == 2


@pytest.mark.parametrize("gone_at_s", [60.0, 120.0, 180.0])
def test_the_reserved_pool_is_recalled_when_every_spot_instance_is_gone(gone_at_s):
    """Spot instances vanish for good in the middle of a step: the reserved engines resume it,
    no step waits (stall_s 0), and every step still trains exactly its workload."""
    sim = run(HYBRID, [(0.0, 4), (gone_at_s, 0)], steps=6)
    assert len(sim.records) == 6 and sim.totals.stall_s == 0.0
    assert sim.totals.generated == sim.totals.trained + sim.totals.lost


def test_a_recall_happens_when_the_pool_dies_after_the_seeding_window():
    recalls = [run(HYBRID, [(0.0, 4), (t, 0)], steps=4).totals.recalls for t in (115.0, 155.0)]
    assert all(recalls), recalls  # both land after a seeding window (mid-rollout: steps take ~40 s)


def test_the_hybrid_holds_the_pool_the_coordinator_asks_for():
    """Offered more instances than N_prem asks for (the 14B step is bound by training), the
    hybrid hands the surplus back between steps (losing no work) and pays less;
    hybrid-all-spot keeps them all."""
    offered = [(0.0, 12)]
    sized, every = (
        Simulation(paper_14b(), system, offered, seed=3, max_steps=5).run()
        for system in (HYBRID, HYBRID_ALL_SPOT)
    )
    assert sized.totals.scaled_in > 0 and every.totals.scaled_in == 0
    assert sized.fleet.wanted is not None and sized.fleet.wanted < 12
    held = [summarize(sim)["mean_pool_instances"] for sim in (sized, every)]
    assert held[0] < held[1] == pytest.approx(12, rel=0.05)
    assert sized.totals.generated == sized.totals.trained  # nothing lost to a hand-back

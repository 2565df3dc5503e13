"""The scenario that mirrors a local deployment (bench/sim_vs_real.py): its engine costs the
emulated sleep plus the measured compute, its trainer runs at the measured rate, and a run of
it trains exactly the fixed-length workload."""

import pytest

from services.sim.real_profile import DeploymentFigures, compute_at, engine_profile, scenario
from services.sim.simulation import Simulation
from services.sim.systems import HYBRID_ALL_SPOT

FIGURES = DeploymentFigures(
    step_delay_ms=30.0,
    step_delay_per_request_ms=1.5,
    compute_ms={1: 0.8, 8: 1.2, 32: 2.4},
    prefill_tokens_per_s=20_000.0,
    slots=32,
    flush_tokens=4,
    heartbeat_ttl_s=1.0,
    prompts_per_step=8,
    group_size=4,
    response_tokens=64,
    prompt_tokens=6,
    train_s=0.2,
    publish_s=0.1,
    reserved_pull_s=0.08,
    pool_pull_s=0.3,
)


def test_the_engine_costs_the_emulated_sleep_plus_the_measured_compute():
    assert compute_at(FIGURES, 1) == 0.8
    assert compute_at(FIGURES, 20) == pytest.approx(1.2 + (2.4 - 1.2) * 12 / 24)
    assert compute_at(FIGURES, 128) == 2.4  # flat past the last measurement
    profile = engine_profile(FIGURES)
    assert profile.step_s(8, 40) == pytest.approx((30.0 + 1.5 * 8 + 1.2) / 1000)


def test_a_simulated_run_trains_the_workload_at_the_measured_rate():
    sc = scenario(FIGURES)
    assert sc.trainer.tokens_per_s == pytest.approx(FIGURES.tokens_per_step / FIGURES.train_s)
    sim = Simulation(sc, HYBRID_ALL_SPOT, [(0.0, 3)], max_steps=3).run()
    per_step = FIGURES.prompts_per_step * FIGURES.group_size * FIGURES.response_tokens
    assert [r.tokens for r in sim.records] == [per_step] * 3
    assert sim.totals.generated == sim.totals.trained

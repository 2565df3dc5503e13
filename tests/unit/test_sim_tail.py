"""The simulator's long tail (services/sim/tail.py, ceiling.py; issue 50): the acceptance model
keeps its mean, speculation and length-aware dispatch change nothing when off, and the trace's
ceiling bounds every system."""

import math
import random
from dataclasses import replace

import pytest

from services.sim.ceiling import ceiling, mean_offered
from services.sim.compare import compare, summarize
from services.sim.engine import SimEngine
from services.sim.profile import QWEN3_14B, roofline
from services.sim.scenario import paper_14b
from services.sim.simulation import Simulation
from services.sim.systems import HYBRID, RESERVED_ONLY
from services.sim.tail import SpeculationModel, TailPolicy, verify_step

CHURN = [(15.0 * t, n) for t, n in enumerate([4, 2, 4, 1, 3, 0, 4, 2, 4, 3] * 8)]


def small_scenario(tail: TailPolicy = TailPolicy()):
    """The 14B profiles on a small batch of short responses (as tests/unit/test_simulator.py)."""
    sc = paper_14b().with_workload(
        prompts_per_step=16, group_size=4, median_response_tokens=600, max_response_tokens=2048
    )
    cloud = replace(sc.cloud, startup_s=20.0)
    return replace(sc, initial_t_seed_s=5.0, cloud=cloud, tail=tail)


def run(system, tail: TailPolicy = TailPolicy(), steps: int = 6) -> dict:
    sim = Simulation(small_scenario(tail), system, CHURN, seed=3, max_steps=steps).run()
    return summarize(sim)


@pytest.mark.parametrize("alpha", [0.2, 0.6, 0.8])
@pytest.mark.parametrize("k", [1, 4])
def test_a_drafted_step_yields_the_acceptance_models_mean(alpha, k):
    spec = SpeculationModel(draft_tokens=k, alpha=alpha)
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert spec.mean_tokens() == pytest.approx(expected, rel=1e-12)
    rng = random.Random(0)
    draws = [spec.draw_tokens(rng) for _ in range(100_000)]
    assert min(draws) == 1 and max(draws) == k + 1
    assert sum(draws) / len(draws) == pytest.approx(expected, rel=0.01)
    # a segment's speed (steps from the renewal count's normal limit) keeps the mean
    speeds = [spec.speed(2000, alpha, rng) for _ in range(2000)]
    assert sum(speeds) / len(speeds) == pytest.approx(expected, rel=0.01)
    assert all(1.0 <= s <= k + 1 for s in speeds)


def test_requests_acceptances_spread_around_the_mean():
    spec = SpeculationModel(alpha=0.6, alpha_concentration=20.0)
    rng = random.Random(1)
    alphas = [spec.request_alpha(rng) for _ in range(20_000)]
    assert sum(alphas) / len(alphas) == pytest.approx(0.6, abs=0.01)
    assert min(alphas) < 0.4 and max(alphas) > 0.8
    fixed = SpeculationModel(alpha=0.6, alpha_concentration=math.inf)
    assert fixed.request_alpha(rng) == 0.6


def test_verification_costs_more_at_a_full_batch_than_in_the_tail():
    profile = roofline(QWEN3_14B)
    priced = verify_step(profile, SpeculationModel(draft_tokens=4))
    assert priced is not None
    tail = priced(4, 4, 6000) / profile.step_s(4, 6000)
    full = priced(256, 256, 2000) / profile.step_s(256, 2000)
    assert 1.0 < tail < 1.1 < full
    fixed = verify_step(profile, SpeculationModel(verify_cost=1.6))
    assert fixed is not None
    assert fixed(64, 32, 2000) == pytest.approx(1.3 * profile.step_s(64, 2000))


def test_a_segment_changes_speed_mid_job_and_keeps_its_tokens():
    engine = SimEngine(roofline(QWEN3_14B))
    engine.add("a", 0, context=100, offset=0, tokens=100, now=0.0)
    t1 = engine.stall_until + 40 / engine.rate()  # the prefill, then 40 plain steps
    engine.advance(0.0, t1)
    assert engine.generated("a") == 40
    engine.set_speed("a", 3.0)
    assert engine.running["a"].stop_level == pytest.approx(engine.level + 20)
    t2 = t1 + 10 / engine.rate()  # 10 more steps, 30 tokens
    engine.advance(t1, t2)
    assert engine.generated("a") == 70
    assert engine.context_sum() == pytest.approx(100 + 70)
    engine.advance(t2, 1e9)
    assert engine.stopped() == ["a"] and engine.remove("a")[1] == 100


def test_off_by_default_and_a_draft_never_accepted_is_plain_decoding():
    assert not small_scenario().tail.active and not paper_14b().tail.active
    plain = run(HYBRID)
    # length-aware without history orders nothing; speculation accepting nothing, free to verify
    assert run(HYBRID, TailPolicy(length_aware=True)) == plain
    idle = TailPolicy(speculation=SpeculationModel(alpha=0.0, verify_cost=1.0), epoch_steps=1)
    assert run(HYBRID, idle) == plain


def test_speculation_and_length_aware_dispatch_shorten_the_rollout():
    plain = run(RESERVED_ONLY)
    siblings = run(RESERVED_ONLY, TailPolicy(speculation=SpeculationModel(alpha=0.8)))
    history = run(RESERVED_ONLY, TailPolicy(speculation=SpeculationModel(alpha=0.8), epoch_steps=1))
    assert history["mean_rollout_s"] < siblings["mean_rollout_s"] < plain["mean_rollout_s"]
    for out in (siblings, history):  # every token generated is trained
        assert out["tokens_generated"] == out["tokens_trained"] == plain["tokens_trained"]
    aware = run(HYBRID, TailPolicy(length_aware=True, epoch_steps=1))
    assert aware["tokens_trained"] == run(HYBRID)["tokens_trained"]


def test_length_aware_queue_is_longest_expected_first():
    sc = small_scenario(TailPolicy(length_aware=True, epoch_steps=1))
    sim = Simulation(sc, HYBRID, CHURN, seed=3, max_steps=3)
    sim.start_step(1)
    st = sim.inflight[1]
    expected = [st.expected[job.request_id] for job in st.queue]
    assert len(expected) == 64 and expected == sorted(expected, reverse=True)
    # noisy: the order is not the true lengths' order, but close to it
    true = [st.lengths[job.request_id] for job in st.queue]
    assert true != sorted(true, reverse=True)
    assert sum(true[:16]) > 2 * sum(true[-16:])


@pytest.mark.parametrize(
    "tail", [TailPolicy(), TailPolicy(speculation=SpeculationModel(alpha=0.8), epoch_steps=1)]
)
def test_the_ceiling_bounds_every_system(tail):
    out = compare(small_scenario(tail), CHURN, horizon_s=300, seed=1).result()
    top = out["ceiling_throughput_tok_s"]
    assert top > 0
    for name, system in out["systems"].items():
        assert 0 < system["throughput_tok_s"] <= top, name
        assert system["ceiling_share"] == pytest.approx(system["throughput_tok_s"] / top)


def test_the_ceiling_is_the_trainer_or_the_pool_and_the_node_together():
    sc = small_scenario()
    assert mean_offered([(0.0, 2), (50.0, 4)], 100.0) == 3.0
    assert mean_offered([(10.0, 4)], 20.0) == 2.0
    rich = ceiling(sc, [(0.0, 64)], 3600.0)
    assert rich.throughput_tok_s == rich.train_tok_s  # the pool outruns the trainer
    bare = ceiling(sc, [], 3600.0)
    assert bare.pool_tok_s == 0.0
    gen, train = bare.reserved_gen_tok_s, bare.train_tok_s
    assert bare.throughput_tok_s == pytest.approx(train * gen / (gen + train))

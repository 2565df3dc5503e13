"""Bounded-staleness asynchronous RL in the simulator (hybrid-async, `SystemSpec.max_staleness`):
k = 0 is the synchronous protocol exactly; k = 1 and 2 complete steps with the token accounting
balanced and no job on weights older than its step minus k; k = 1 trains faster on a steady pool."""

from dataclasses import replace
from itertools import pairwise

import pytest

from services.sim.compare import summarize
from services.sim.simulation import Simulation
from services.sim.systems import HYBRID, HYBRID_ASYNC_K1, HYBRID_ASYNC_K2, SYSTEMS
from tests.unit.test_simulator import CHURN, run


def in_flight(sim: Simulation) -> int:
    """Response tokens collected for steps not yet committed."""
    return sum(st.table.response_tokens for st in sim.inflight.values())


def test_the_async_systems_are_compared():
    names = [s.name for s in SYSTEMS]
    assert "hybrid-async-k1" in names and "hybrid-async-k2" in names
    assert HYBRID_ASYNC_K1.max_staleness == 1 and HYBRID_ASYNC_K2.max_staleness == 2
    assert all(s.max_staleness == 0 for s in SYSTEMS if not s.name.startswith("hybrid-async"))


# hybrid's figures on these traces as the simulator made them before it had an asynchronous
# mode (at 273ed6d): steps, tokens generated, the last commit's time, migrations by cause
SYNC_BEFORE = [
    (CHURN, 8, 403850, 395.31930040835414, {"balance": 72, "seed": 114, "death": 44}),
    ([(0.0, 4)], 8, 403504, 342.6186383380657, {"balance": 44, "seed": 146}),
    (
        [(0.0, 4), (120.0, 0)],
        8,
        403578,
        424.84628870549824,
        {"balance": 52, "seed": 30, "death": 6},
    ),
]


@pytest.mark.parametrize(("targets", "steps", "generated", "end_s", "migrations"), SYNC_BEFORE)
def test_k0_is_the_synchronous_hybrid_as_it_was(targets, steps, generated, end_s, migrations):
    for system in (HYBRID, replace(HYBRID, name="hybrid-k0", max_staleness=0)):
        sim = run(system, targets)
        assert len(sim.records) == steps and sim.totals.trained == 403504
        assert sim.totals.generated == generated and sim.records[-1].end_s == end_s
        assert sim.totals.migrations == migrations and sim.requests.max_lag == 0


@pytest.mark.parametrize("system", [HYBRID_ASYNC_K1, HYBRID_ASYNC_K2])
@pytest.mark.parametrize("notice_s", [0.0, 30.0])
def test_async_steps_complete_balanced_and_within_the_staleness_bound(system, notice_s):
    sim = run(system, CHURN, notice_s=notice_s)
    t = sim.totals
    assert len(sim.records) == 8 and t.preemptions > 0
    assert t.generated == t.trained + t.lost + in_flight(sim)
    work = sim.sc.workload
    assert [r.tokens for r in sim.records] == [
        work.step(3, r.step).total_response_tokens for r in sim.records
    ]
    # `start_job` asserts the bound on every job; the largest lag seen is k: steps overlapped
    assert sim.requests.max_lag == system.max_staleness
    assert t.stall_s == 0.0


@pytest.mark.parametrize("system", [HYBRID_ASYNC_K1, HYBRID_ASYNC_K2])
def test_async_stopped_mid_run_holds_its_steps_in_flight(system):
    """Cut by the horizon, later steps are in flight: their collected tokens balance the count."""
    sim = Simulation(run(system, CHURN).sc, system, CHURN, seed=3, horizon_s=500.0).run()
    assert sim.records and sim.inflight
    assert len(sim.inflight) <= system.max_staleness + 1
    assert max(sim.inflight) - min(sim.inflight) <= system.max_staleness
    assert sim.totals.generated == sim.totals.trained + sim.totals.lost + in_flight(sim)


def test_async_recalls_the_reserved_node_when_the_pool_is_gone():
    """Every spot instance goes for good: the reserved engines generate, then train, in turn."""
    sim = run(HYBRID_ASYNC_K1, [(0.0, 4), (60.0, 0)], steps=6)
    assert len(sim.records) == 6 and sim.totals.stall_s == 0.0
    assert sim.totals.recalls >= 2
    assert sim.totals.generated == sim.totals.trained + sim.totals.lost


def test_k1_trains_faster_than_the_synchronous_hybrid_on_a_steady_pool():
    steady = [(0.0, 4)]
    sync, k1 = (summarize(run(s, steady, steps=10)) for s in (HYBRID, HYBRID_ASYNC_K1))
    assert sync["preemptions"] == k1["preemptions"] == 0
    assert k1["throughput_tok_s"] >= sync["throughput_tok_s"]


def test_a_version_is_published_while_the_next_steps_groups_train():
    """With k >= 1 the trainer trains the next step's groups while the version goes out, as
    the services' trainer does: on a trainer-bound run steps follow each other by their
    training and optimizer time, not by the publication's too; versions commit in order."""
    sc = run(HYBRID_ASYNC_K1, [(0.0, 4)], steps=1).sc
    trainer = replace(sc.trainer, mfu=sc.trainer.mfu / 20, publish_s=20.0)
    slow = replace(sc, trainer=trainer)
    sim = Simulation(slow, HYBRID_ASYNC_K1, [(0.0, 4)], seed=3, max_steps=8).run()
    records = sim.records
    assert [r.step for r in records] == list(range(8))
    gaps = [b.end_s - a.end_s for a, b in pairwise(records[3:])]
    budgets = [r.train_s + trainer.optimizer_s for r in records[4:]]
    assert min(budgets) > 3 * trainer.publish_s  # trainer-bound
    for gap, budget in zip(gaps, budgets, strict=True):
        assert budget - 1.0 < gap < budget + 1.0, (gaps, budgets)

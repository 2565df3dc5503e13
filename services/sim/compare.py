"""Run every system on the same scenario, trace and seed, and summarise: effective throughput
(response tokens trained per second), cost efficiency (tokens per dollar), step time, idle
fractions, and the token accounting that must balance; and the trace's ceiling (ceiling.py)
with each system's share of it (`ceiling_share`).

Every figure is taken at the commit of the last complete step, so no system is charged for, or
credited with, a step it had not finished when the trace window closed.
"""

import math
from dataclasses import asdict, dataclass

from services.sim.ceiling import Ceiling, ceiling
from services.sim.scenario import Scenario
from services.sim.simulation import Simulation
from services.sim.state import finite_or_none
from services.sim.systems import DISAGG_BAL, SYSTEMS, SystemSpec

CALIBRATION_STEPS = 3
MAX_FIXED_POOL = 16
BALANCE_SHARE = 0.95


def summarize(sim: Simulation) -> dict:
    records = sim.records
    end_s = records[-1].end_s if records else 0.0
    totals = sim.totals
    reserved_cost = sim.sc.cloud.reserved_node_per_h * sim.system.reserved_nodes * end_s / 3600
    pool = [i for i in sim.fleet.instances.values() if i.pool == "preemptible"]
    pool_s = sum(i.alive_s(end_s) for i in pool)
    pool_busy_s = sum(min(i.engine.busy_s, i.alive_s(end_s)) for i in pool)
    pool_cost = sum(i.alive_s(end_s) * i.price_per_h / 3600 for i in pool)
    reserved_busy = totals.reserved_rollout_s + totals.reserved_train_s + totals.reserved_switch_s
    cost = reserved_cost + pool_cost
    seeded = [r.t_seed_s for r in records if not math.isinf(r.t_seed_s)]
    n_prem = [r.n_prem_recommended for r in records if r.spot_instances and r.n_prem_recommended]
    out = {
        "steps": len(records),
        "hours": end_s / 3600,
        "throughput_tok_s": totals.trained / end_s if end_s else 0.0,
        "tokens_per_dollar": totals.trained / cost if cost else 0.0,
        "mean_step_s": end_s / len(records) if records else None,
        "mean_rollout_s": sum(r.rollout_s for r in records) / len(records) if records else None,
        "cost_per_h": cost / (end_s / 3600) if end_s else 0.0,
        "mean_pool_instances": pool_s / end_s if end_s else 0.0,
        "reserved_idle_frac": max(0.0, 1 - reserved_busy / end_s) if end_s else 0.0,
        "pool_idle_frac": 1 - pool_busy_s / pool_s if pool_s else None,
        "mean_t_seed_s": sum(seeded) / len(seeded) if seeded else None,
        "mean_n_prem_recommended": sum(n_prem) / len(n_prem) if n_prem else None,
        "tokens_trained": totals.trained,
        "tokens_generated": totals.generated,
        "tokens_lost": totals.lost,
        "preemptions": totals.preemptions,
        "migrations": dict(sorted(totals.migrations.items())),
        "balance_migrations_per_step": (
            totals.migrations.get("balance", 0) / len(records) if records else None
        ),
        "requests_per_step": sim.sc.workload.prompts_per_step * sim.sc.workload.group_size,
        "stall_s": totals.stall_s,
        "recalls": totals.recalls,
        "scaled_in": totals.scaled_in,
    }
    if sim.sc.workload.turns > 1:
        out |= episode_figures(sim)
    return out


def episode_figures(sim: Simulation) -> dict:
    """A multi-turn run's episodes: turns the environment answered, episodes over, whole turns
    thrown away by restarts (migration off), the mean seconds a turn waited for an answer."""
    totals = sim.totals
    return {
        "env_answers": totals.env_answers,
        "episodes": totals.episodes,
        "turns_per_episode": totals.env_answers / totals.episodes if totals.episodes else None,
        "turns_discarded": totals.turns_discarded,
        "mean_env_s": totals.env_s / totals.env_answers if totals.env_answers else None,
    }


@dataclass
class Comparison:
    scenario: Scenario
    sims: dict[str, Simulation]
    summaries: dict[str, dict]
    disagg_instances: int
    ceiling: Ceiling | None = None  # the trace's (ceiling.py)

    def ratio(self, a: str, b: str, key: str) -> float | None:
        x, y = self.summaries.get(a, {}).get(key), self.summaries.get(b, {}).get(key)
        return finite_or_none(x / y) if x and y else None

    def result(self) -> dict:
        return {
            "scenario": self.scenario.name,
            "disagg_bal_instances": self.disagg_instances,
            "systems": self.summaries,
            "hybrid_vs_reserved_throughput": self.ratio(
                "hybrid", "reserved-only", "throughput_tok_s"
            ),
            "hybrid_vs_reserved_cost_efficiency": self.ratio(
                "hybrid", "reserved-only", "tokens_per_dollar"
            ),
            # the ablations hold every instance offered, as hybrid-all-spot does
            "seeding_gain": self.ratio("hybrid-all-spot", "hybrid-no-seeding", "throughput_tok_s"),
            "migration_gain": self.ratio(
                "hybrid-all-spot", "hybrid-no-migration", "throughput_tok_s"
            ),
            "fair_reads_gain": self.ratio(
                "hybrid-all-spot", "hybrid-plateau-reads", "throughput_tok_s"
            ),
            "pool_sizing_cost_gain": self.ratio("hybrid", "hybrid-all-spot", "tokens_per_dollar"),
            # bounded-staleness asynchronous RL (k = 1, 2) against the synchronous hybrid
            "async_k1_vs_hybrid_throughput": self.ratio(
                "hybrid-async-k1", "hybrid", "throughput_tok_s"
            ),
            "async_k2_vs_hybrid_throughput": self.ratio(
                "hybrid-async-k2", "hybrid", "throughput_tok_s"
            ),
            "async_k1_vs_hybrid_cost_efficiency": self.ratio(
                "hybrid-async-k1", "hybrid", "tokens_per_dollar"
            ),
            "async_k2_vs_hybrid_cost_efficiency": self.ratio(
                "hybrid-async-k2", "hybrid", "tokens_per_dollar"
            ),
            "hybrid_balance_migrations_per_step": self.summaries.get("hybrid", {}).get(
                "balance_migrations_per_step"
            ),
            "ceiling_throughput_tok_s": self.ceiling.throughput_tok_s if self.ceiling else None,
        } | self.tail()

    def tail(self) -> dict:
        """The long tail's options (services/sim/tail.py), where any is on."""
        tail = self.scenario.tail
        if not tail.active:
            return {}
        spec = tail.speculation
        return {
            "speculation": None if spec is None else asdict(spec),
            "length_aware": tail.length_aware,
            "epoch_steps": tail.epoch_steps,
            "length_noise_sigma": tail.length_noise_sigma,
        }


def balanced_pool_size(scenario: Scenario, seed: int) -> int:
    """Disagg.BAL's pool: the fewest on-demand instances that come within `BALANCE_SHARE` of
    the best throughput any pool up to `MAX_FIXED_POOL` reaches over a few steps. Past that
    point the step is bound by training and by the long tail of the slowest responses, which
    more instances do not shorten, so more would only add cost."""
    rates = {}
    for n in range(1, MAX_FIXED_POOL + 1):
        sim = Simulation(scenario, DISAGG_BAL.sized(n), [], seed, max_steps=CALIBRATION_STEPS)
        sim.run()
        rates[n] = sim.totals.trained / sim.records[-1].end_s
    best = max(rates.values())
    return min(n for n, rate in rates.items() if rate >= BALANCE_SHARE * best)


def compare(
    scenario: Scenario,
    targets: list[tuple[float, int]],
    horizon_s: float,
    seed: int = 0,
    systems: tuple[SystemSpec, ...] = SYSTEMS,
) -> Comparison:
    disagg = balanced_pool_size(scenario, seed) if DISAGG_BAL in systems else 0
    sims = {}
    for system in systems:
        spec = system.sized(disagg) if system == DISAGG_BAL else system
        sims[system.name] = Simulation(scenario, spec, targets, seed, horizon_s).run()
    summaries = {name: summarize(sim) for name, sim in sims.items()}
    top = ceiling(scenario, targets, horizon_s, seed)
    for summary in summaries.values():  # each system's share of what the trace allows
        summary["ceiling_share"] = summary["throughput_tok_s"] / top.throughput_tok_s
    return Comparison(scenario, sims, summaries, disagg, top)

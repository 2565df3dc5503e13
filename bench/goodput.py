"""Goodput under churn (issue 53): the effective training time ratio (ETTR) of a real run while
a spot trace takes its preemptible workers away, against the same run unharmed and against a
restart baseline, side by side in one invocation (each arm a fresh local deployment: one
reserved worker, up to `--max-workers` preemptible ones, one trainer; the same spec and seed).

- `unharmed`: every preemptible worker stays all along.
- `spotrl`: the trace (`--trace`, from `--start-hours` for `--hours`, compressed so that it
  spans about the unharmed run's wall time) replayed by `spotrl chaos`'s runner: as the
  trace's offer falls, workers are preempted, `--sigterm-fraction` of them with the notice
  (SIGTERM: the worker gives its requests back and leaves within its grace) and the rest
  without (SIGKILL: the coordinator reclaims them once the heartbeat lapses); as it rises, new
  ones join. Their requests continue elsewhere from their collected tokens.
- `restart`: the same trace, the same victims, as a framework without token-level migration
  does: `rollout.migration` off (a lost worker's requests start again from token 0), and every
  loss without notice also takes the trainer down (SIGKILL: a job that lost a node), which
  comes back on the same port and resumes from its checkpoint.

ETTR = the trainer's time on steps that count / the run's wall time (submit to its end). A step
counts once its version is committed; the trainer's time on it is the step's `step_s` (from the
announce of the version that generated it to the commit of the version trained on it), less the
rollout time that went to regenerating tokens (its `regenerated_tokens` over its tokens per
second). Not counted: the start (until version 0 is announced), a trainer's downtime and the
training it lost, and regenerated work. A step made slower by fewer workers still counts: the
capacity the trace leaves is not a failure. Also: `regenerated_tokens` (tokens received beyond
those kept: a request restarted, or a migrated one's overlap), `stall_s` (the wall time the losses
and the trace added: an arm's wall less the unharmed one), `lost` and `duplicated` (the audit),
and the simulator's estimate for the same trace: the paper-14b scenario's hybrid-all-spot (with
migration) and the same without migration, the same ETTR (`sim_ettr`).

Regime: CPU, 2 cores; the engine sleeps `--step-delay-ms` after each decode step and every
response is `--max-new-tokens` long (`ignore_eos`) so that a response is in flight long enough
to be preempted, standing in for a larger model: rollout is most of a step. Synchronous runs
(`--max-staleness 0`): steps do not overlap, so their times add up to at most the wall time.

    .venv/bin/python bench/goodput.py [--steps 12] [--max-workers 3]

Prints one line per arm and, as its LAST line, one JSON object.
"""

import argparse
import json
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import repo_root  # noqa: F401  (the repository root on sys.path: tests.harness)

from bench.runs import wait_final
from services.cli.audit import audit_run
from services.cli.chaos import ChaosOptions, ChaosRunner
from services.cli.client import CoordinatorClient
from services.cli.up import ensure_model, sized_for
from services.contracts.runspec import RunSpec
from services.infra.traces import load_trace, worker_targets
from services.sim.scenario import SCENARIOS
from services.sim.simulation import Simulation
from services.sim.systems import HYBRID_ALL_SPOT
from tests.harness.deploy import Deployment, DeploymentConfig

TRACE = Path(__file__).resolve().parents[1].parent / "shared/traces"
DEFAULT_TRACE = TRACE / "aws-g4dn-xlarge-us-east-1c-2020-11-20.csv"
ARMS = ("unharmed", "spotrl", "restart")


def productive_s(rows: list[dict]) -> float:
    """The trainer's time on the steps that count: each committed step's wall time in the
    trainer (`step_s`: from the announce of the version that generated it to the commit of the
    version trained on it), less the rollout time its regenerated tokens took at the step's own
    rate (tokens received beyond those kept, over its tokens per second)."""
    total = 0.0
    for row in rows:
        step_s = row.get("step_s") or 0.0
        rate = row.get("tokens_per_s") or 0.0
        regenerated = row.get("regenerated_tokens") or 0
        total += step_s - (min(step_s, regenerated / rate) if rate > 0 else 0.0)
    return total


class TrainerKiller:
    """The restart baseline's second half: each loss without notice the chaos runner deals also
    takes the trainer down (SIGKILL), and it is started again on the same port."""

    def __init__(self, dep: Deployment, chaos: ChaosRunner) -> None:
        self.dep, self.chaos = dep, chaos
        self.restarts = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trainer-killer", daemon=True)

    def _run(self) -> None:
        seen = 0
        while not self.stop.wait(0.05):
            if self.chaos.counts["sigkill"] > seen:
                seen = self.chaos.counts["sigkill"]
                self.dep.restart("trainer")
                self.restarts += 1


def run_arm(arm: str, args, spec: RunSpec, model: Path, time_scale: float | None) -> dict:
    options = ChaosOptions(
        trace=args.trace,
        time_scale=time_scale or 1.0,
        max_workers=args.max_workers,
        hours=args.hours,
        start_s=args.start_hours * 3600,
        sigterm_fraction=args.sigterm_fraction,
        grace_s=args.grace_s,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
    )
    if arm == "restart":
        spec = spec.model_copy(
            update={"rollout": spec.rollout.model_copy(update={"migration": False})}
        )
    with tempfile.TemporaryDirectory(prefix=f"spotrl-goodput-{arm}-") as scratch:
        config = DeploymentConfig(
            Path(args.work_dir / arm if args.work_dir else scratch),
            reserved=1,
            preemptible=args.max_workers,
            worker_env=options.worker_env() | {"SPOTRL_STEP_DELAY_MS": str(args.step_delay_ms)},
        )
        config = sized_for(config, spec, 2)
        with Deployment(config) as dep, CoordinatorClient(dep.coordinator_url) as client:
            chaos = killer = None
            if arm != "unharmed":
                chaos = ChaosRunner(dep, options.targets(args.max_workers), args.sigterm_fraction)
            began = time.monotonic()
            run_id = client.submit(json.loads(spec.model_dump_json()))
            if chaos is not None:
                chaos.start()
            if arm == "restart" and chaos is not None:
                killer = TrainerKiller(dep, chaos)
                killer.thread.start()
            run = wait_final(client, run_id, args.timeout_s)
            wall = time.monotonic() - began
            if chaos is not None:
                chaos.stop()
            if killer is not None:
                killer.stop.set()
                killer.thread.join(120)
            rows = client.metrics(run_id)
            audit = audit_run(dep.redis_url, run_id, spec)
    productive = productive_s(rows)
    return {
        "state": run["state"],
        "wall_s": wall,
        "productive_s": productive,
        "ettr": productive / wall,
        "steps": len(rows),
        "regenerated_tokens": sum(row.get("regenerated_tokens") or 0 for row in rows),
        "migrations": sum_counts(row.get("migrations") for row in rows),
        "losses": dict(chaos.counts) if chaos is not None else {},
        "trainer_restarts": killer.restarts if killer is not None else 0,
        "lost": audit["lost"],
        "duplicated": audit["duplicated"],
    }


def sum_counts(parts) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for key, n in (part or {}).items():
            out[key] = out.get(key, 0) + n
    return out


def simulated_ettr(args) -> dict:
    """The simulator's trainer time over wall time on the same trace window (paper-14b)."""
    targets = worker_targets(
        load_trace(args.trace), 1.0, args.sim_max_spot, args.hours, args.start_hours * 3600
    )
    k = args.max_staleness
    base = HYBRID_ALL_SPOT
    if k:  # asynchronous as the real runs: no seeding window, k steps in flight
        base = replace(base, name=f"{base.name}-async-k{k}", seeding="off", max_staleness=k)
    restart = replace(base, name=f"{base.name}-no-migration", migration=False, balancing=False)
    out = {}
    for system in (base, restart):
        sim = Simulation(SCENARIOS["paper-14b"](), system, targets, args.seed, args.hours * 3600)
        sim.run()
        out[system.name] = sim_ettr(sim)
    return out


def sim_ettr(sim: Simulation) -> float | None:
    """The same ETTR in the simulation: each committed step's time, less the rollout time of
    the tokens thrown away (lost unflushed, or discarded by a restart) at the step's share of
    the run's generation, over the time to the last commit."""
    records, totals = sim.records, sim.totals
    if not records or not totals.generated:
        return None
    wasted = (totals.lost_unflushed + totals.discarded) / totals.generated
    steps_s = sum(r.end_s - r.start_s for r in records)
    return (steps_s - wasted * sum(r.rollout_s for r in records)) / records[-1].end_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-workers", type=int, default=3, help="preemptible workers at most")
    parser.add_argument("--max-staleness", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--step-delay-ms", type=float, default=20.0)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--start-hours", type=float, default=6.0)
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--sigterm-fraction", type=float, default=0.5)
    parser.add_argument("--grace-s", type=float, default=5.0)
    parser.add_argument("--heartbeat-ttl-s", type=float, default=2.0)
    parser.add_argument("--sim-max-spot", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the logs there")
    args = parser.parse_args()
    arms = args.arms.split(",")
    if arms[0] != "unharmed" or not set(arms) <= set(ARMS):
        parser.error(f"--arms: unharmed first, then of {', '.join(ARMS[1:])}")
    model = ensure_model(Path(".spotrl/models/arithmetic-base"), "arithmetic", None, None)
    spec = RunSpec.model_validate(
        {
            "model": str(model.resolve()),
            "steps": args.steps,
            "seed": args.seed,
            "max_new_tokens": args.max_new_tokens,
            "ignore_eos": True,
            "max_staleness": args.max_staleness,
        }
    )
    out: dict = {"task": "arithmetic", "trace": args.trace.name, "steps": args.steps}
    time_scale = None
    for arm in arms:
        out[arm] = run_arm(arm, args, spec, model, time_scale)
        print(arm, json.dumps(out[arm]), file=sys.stderr, flush=True)
        if arm == "unharmed":  # the trace window spans about the unharmed run
            time_scale = args.hours * 3600 / out[arm]["wall_s"]
            out["time_scale"] = time_scale
    unharmed = out["unharmed"]
    if "spotrl" in out:
        out["ettr"] = out["spotrl"]["ettr"]
        out["regenerated_tokens"] = out["spotrl"]["regenerated_tokens"]
        out["stall_s"] = out["spotrl"]["wall_s"] - unharmed["wall_s"]
    if "restart" in out:
        out["ettr_restart_baseline"] = out["restart"]["ettr"]
        out["regenerated_tokens_baseline"] = out["restart"]["regenerated_tokens"]
        out["stall_s_baseline"] = out["restart"]["wall_s"] - unharmed["wall_s"]
    out["ettr_unharmed"] = unharmed["ettr"]
    out["ettr_sim"] = simulated_ettr(args)
    out["lost"] = sum(out[arm]["lost"] for arm in arms)
    out["duplicated"] = sum(out[arm]["duplicated"] for arm in arms)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

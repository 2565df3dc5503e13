"""Several RL runs on one trace (issue 52): K runs on one shared spot pool against K separate
deployments, with the same reserved nodes (one a run) and the same trace
(services/sim/shared_pool.py; docs/simulation.md, "Many runs on one pool").

    .venv/bin/python bench/sim_many_runs.py --trace ../shared/traces/FILE.csv
        [--runs 4] [--spot-per-run 8] [--hours 2] [--start-hours 0]
        [--slots max_seqs|plateau|N] [--leave release|drain] [--place-at-commit]
        [--serve one|all] [--adapter-share 0.0043] [--unmerged-decode-factor 1.0]
        [--stagger-s 0] [--system hybrid-all-spot|hybrid-async-k1-all-spot]
        [--shared-spot-per-run N] [--place-every-s 1] [--scenario paper-14b|artifact-8b] [--seed 0]

The trace's peak maps to `--spot-per-run` x `--runs` spot instances: the shared pool holds them
all; separate deployment d holds instance i of the trace's n when i mod K = d. In the shared
pool the coordinator's `core.fleet_shares` (`allot`, `place`) places every instance on a run
each `--place-every-s`, seeing `--slots` a worker (its engine's cap, as heartbeats say today; its
measured plateau batch; or N); a worker placed on another run gives back what it holds at once
(`--leave release`, the services' worker) or first finishes it (`drain`), then pulls the new
run's whole weights. `--place-at-commit` also places the pool for a run's next step at its
commit, before the step opens (its seeding window then counts the workers placed on it).
`--shared-spot-per-run` sizes the shared pool apart (default `--spot-per-run`: the same trace).

`--serve all`: LoRA runs on one base (both setups' weights are LoRA's: a version is an adapter of
`--adapter-share` of the model's bytes, the base pulled once an instance), and every instance of
the shared pool serves every run at once, one batch, each request under its run's adapter (a
worker's SPOTRL_RUNS_AT_ONCE >= runs): no moves, each run reading up to its part of an
instance (services/sim/lanes.py); its engines decode at `--unmerged-decode-factor` of a merged
engine's speed (the separate deployments' one-run workers merge). `--stagger-s S`: run r starts
at r S, in both setups. `--system`: each run's system (async k = 1: its next step rolls out while
it trains). The defaults are the services' behaviour for full-weight runs, started together.

Prints a table, then as its LAST line a JSON object: `shared` and `separate`, each with
`pool_idle_frac` (share of the spot instance-seconds up, i.e. booted, with no request held),
`pool_idle_frac_billed` (of the seconds billed, boots included), `tokens_per_dollar`,
`throughput_tok_s`, `mean_step_s` and `steps` (a list, one a run), `switches` (instances moved
between runs), `switch_frac` (the share of the up time spent pulling another run's weights),
`cost_per_h`, `mean_pool_instances`, token accounting; and `runs`, `trace`, `hours`,
`start_hours`, `seed`, `spot_per_run`, `shared_spot_per_run`, `slots`, `leave`,
`place_at_commit`, `serve`, `adapter_share` (None: full weights), `unmerged_decode_factor`,
`stagger_s`, `system`, `scenario`, `wall_s`. Each setup also has `first_step_s` (each run's
start) and the shared one `several_runs_frac` (of its busy instance-seconds, those with two runs
or more in one batch).
"""

import argparse
import json
import sys
import time
from pathlib import Path

from services.infra.traces import TraceError, load_trace, worker_targets
from services.sim.scenario import SCENARIOS
from services.sim.shared_pool import MANY_RUNS_SYSTEMS, ManyRuns, compare_many_runs

# a rank-16 adapter on every linear layer of Qwen3-14B, in bf16 as its base: 16 x 100,352
# parameters a layer (q, k, v, o, gate, up, down: r (in + out) each) x 40 layers = 64.2M of
# 14.8B (docs/simulation.md, "Many runs on one pool")
ADAPTER_SHARE = 0.0043


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, type=Path, help="CSV `seconds,available`")
    p.add_argument("--runs", type=int, default=4, help="RL runs, each with one reserved node")
    p.add_argument("--spot-per-run", type=int, default=8, help="spot instances a run at peak")
    p.add_argument("--hours", type=float, default=2.0, help="hours of the trace to simulate")
    p.add_argument("--start-hours", type=float, default=0.0, help="where in the trace to start")
    p.add_argument("--slots", default="max_seqs", help="max_seqs, plateau, or a number")
    p.add_argument("--leave", choices=("release", "drain"), default="release")
    p.add_argument("--place-at-commit", action="store_true", help="place before a step opens")
    p.add_argument("--serve", choices=("one", "all"), default="one", help="runs an instance serves")
    p.add_argument("--adapter-share", type=float, help="LoRA: an adapter's bytes over the model's")
    p.add_argument("--unmerged-decode-factor", type=float, default=1.0, help="--serve all")
    p.add_argument("--stagger-s", type=float, default=0.0, help="run r starts at r times this")
    p.add_argument("--system", choices=sorted(MANY_RUNS_SYSTEMS), default="hybrid-all-spot")
    p.add_argument("--shared-spot-per-run", type=int, help="the shared pool's size apart")
    p.add_argument("--place-every-s", type=float, default=1.0, help="placement period")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="paper-14b")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.runs < 1 or args.spot_per_run < 0 or args.place_every_s <= 0:
        p.error("--runs must be >= 1, --spot-per-run >= 0, --place-every-s > 0")
    if args.hours <= 0 or args.start_hours < 0:
        p.error("--hours must be > 0, --start-hours >= 0")
    if args.slots not in ("max_seqs", "plateau"):
        if not args.slots.isdigit() or int(args.slots) < 1:
            p.error("--slots must be max_seqs, plateau or a number >= 1")
        args.slots = int(args.slots)
    if args.shared_spot_per_run is None:
        args.shared_spot_per_run = args.spot_per_run
    if args.shared_spot_per_run < 0:
        p.error("--shared-spot-per-run must be >= 0")
    if args.serve == "all" and args.adapter_share is None:
        args.adapter_share = ADAPTER_SHARE
    if args.adapter_share is not None and not 0 < args.adapter_share < 1:
        p.error("--adapter-share must be within (0, 1)")
    if args.stagger_s < 0 or not 0 < args.unmerged_decode_factor <= 1:
        p.error("--stagger-s must be >= 0, --unmerged-decode-factor within (0, 1]")
    return args


def print_table(result: dict) -> None:
    print(
        f"{'setup':9s} {'idle (up)':>9s} {'idle ($)':>8s} {'tok/s':>8s} {'tok/$':>8s} "
        f"{'$/h':>7s} {'pool':>5s} {'switches':>8s} {'several':>7s} {'steps':>12s} mean step s"
    )
    for name in ("separate", "shared"):
        s = result[name]
        steps = "/".join(map(str, s["steps"]))
        means = "/".join("-" if m is None else f"{m:.0f}" for m in s["mean_step_s"])
        several = s.get("several_runs_frac")
        print(
            f"{name:9s} {s['pool_idle_frac'] or 0:9.3f} {s['pool_idle_frac_billed'] or 0:8.3f} "
            f"{s['throughput_tok_s']:8.0f} {s['tokens_per_dollar']:8.0f} {s['cost_per_h']:7.1f} "
            f"{s['mean_pool_instances']:5.1f} {s['switches']:8d} "
            f"{'-' if several is None else f'{several:.3f}':>7s} {steps:>12s} {means}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        print(f"sim_many_runs: {exc}", file=sys.stderr)
        return 2
    scenario = SCENARIOS[args.scenario]()
    if args.adapter_share is not None:  # LoRA runs, in both setups
        scenario = scenario.with_lora(args.adapter_share)
    setup = ManyRuns(
        runs=args.runs,
        system=MANY_RUNS_SYSTEMS[args.system],
        place_every_s=args.place_every_s,
        slots=args.slots,
        leave=args.leave,
        place_at_commit=args.place_at_commit,
        serve=args.serve,
        stagger_s=args.stagger_s,
        unmerged_decode_factor=args.unmerged_decode_factor,
    )
    start_s = args.start_hours * 3600
    targets = worker_targets(trace, 1.0, args.spot_per_run * args.runs, args.hours, start_s)
    shared = worker_targets(trace, 1.0, args.shared_spot_per_run * args.runs, args.hours, start_s)
    began = time.monotonic()
    compared = compare_many_runs(scenario, targets, setup, args.seed, args.hours * 3600, shared)
    print_table(compared)
    result = {
        "scenario": scenario.name,
        "trace": args.trace.name,
        "hours": args.hours,
        "start_hours": args.start_hours,
        "seed": args.seed,
        "spot_per_run": args.spot_per_run,
        "shared_spot_per_run": args.shared_spot_per_run,
        "slots": args.slots,
        "leave": args.leave,
        "place_at_commit": args.place_at_commit,
        "place_every_s": args.place_every_s,
        "serve": args.serve,
        "adapter_share": args.adapter_share,
        "unmerged_decode_factor": args.unmerged_decode_factor,
        "stagger_s": args.stagger_s,
        "system": args.system,
        **compared,
        "wall_s": round(time.monotonic() - began, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

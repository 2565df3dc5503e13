"""Trace-driven simulation: what hybrid rollout on spot capacity saves, by the coordinator's own
policy code (services/sim), against reserved-only, reserved x2 and a balanced disaggregated
pool, with ablations. docs/simulation.md explains the models and the results.

    .venv/bin/python bench/simulate.py --trace ../shared/traces/FILE.csv
        [--hours H] [--start-hours S] [--max-spot N] [--scenario paper-14b|artifact-8b]
        [--notice-s S] [--profile FILE.json] [--seed K] [--plot OUT.png]
        [--turns T] [--env-latency-s S] [--observation-tokens N] [--turn-tokens N]
        [--speculation [--spec-alpha A] [--spec-draft-tokens K] [--spec-verify-cost F]
         [--spec-alpha-concentration C]] [--length-aware [--length-noise-sigma S]]
        [--epoch-steps E] [--systems NAME,NAME,...]

Prints a table, then as its LAST line a JSON object: `systems` (name -> throughput_tok_s,
tokens_per_dollar, mean_step_s, idle fractions, token accounting, ...),
`hybrid_vs_reserved_throughput`, `hybrid_vs_reserved_cost_efficiency`, `seeding_gain`,
`async_k1_vs_hybrid_throughput`, `async_k2_vs_hybrid_throughput` (hybrid-async-k1/k2, bounded-
staleness asynchronous RL, against the synchronous hybrid), ... With `--turns` T > 1 every
response is a multi-turn episode of T model turns (the environment answers each after
`--env-latency-s` on average and appends `--observation-tokens` between turns; a turn's median
is `--turn-tokens`, by default the single-turn median split among the turns); the JSON then
also has `turns`, `env_latency_s`, `observation_tokens`, `turn_median_tokens`, and each
system's episode figures (`env_answers`, `episodes`, `turns_per_episode`, `turns_discarded`,
`mean_env_s`). `ceiling_throughput_tok_s` is the trace's ceiling (services/sim/ceiling.py) and
each system's `ceiling_share` its throughput's share of it. `--speculation` and
`--length-aware` (services/sim/tail.py; off by default) model the long tail's remedies, with
history from step `--epoch-steps` on (the dataset's prompts / prompts a step; default none:
drafts come only from finished siblings); the JSON then also has `speculation`,
`length_aware`, `epoch_steps`, `length_noise_sigma`. `--systems` runs only those named.
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from services.infra.traces import TraceError, load_trace, worker_targets
from services.sim.compare import compare
from services.sim.plot import plot_throughput
from services.sim.profile import EngineProfile
from services.sim.scenario import SCENARIOS
from services.sim.systems import SYSTEMS, SystemSpec
from services.sim.tail import SpeculationModel, TailPolicy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, type=Path, help="CSV `seconds,available`")
    p.add_argument("--hours", type=float, default=24.0, help="hours of the trace to simulate")
    p.add_argument("--start-hours", type=float, default=0.0, help="where in the trace to start")
    p.add_argument("--max-spot", type=int, default=8, help="spot instances at the trace's peak")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="paper-14b")
    p.add_argument("--notice-s", type=float, default=None, help="preemption notice (default 0)")
    p.add_argument("--profile", type=Path, help="measured engine profile (JSON) for spot engines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, help="write the throughput-over-time PNG here")
    p.add_argument("--turns", type=int, default=1, help="model turns per episode (1: single)")
    p.add_argument(
        "--env-latency-s", type=float, default=2.0, help="mean seconds an environment answer takes"
    )
    p.add_argument(
        "--observation-tokens", type=int, default=256, help="tokens appended between two turns"
    )
    p.add_argument(
        "--turn-tokens", type=float, default=None, help="a turn's median tokens (default: split)"
    )
    tail_args(p)
    args = p.parse_args(argv)
    if args.hours <= 0 or args.max_spot < 0 or args.start_hours < 0:
        p.error("--hours must be > 0, --max-spot and --start-hours >= 0")
    if args.turns < 1 or args.env_latency_s < 0 or args.observation_tokens < 0:
        p.error("--turns must be >= 1, --env-latency-s and --observation-tokens >= 0")
    if args.turn_tokens is not None and args.turn_tokens < 1:
        p.error("--turn-tokens must be >= 1")
    return args


def tail_args(p: argparse.ArgumentParser) -> None:
    """The long tail's options (services/sim/tail.py), off by default."""
    defaults = SpeculationModel()
    p.add_argument("--speculation", action="store_true", help="drafts from history and siblings")
    p.add_argument("--spec-alpha", type=float, default=defaults.alpha, help="mean acceptance")
    p.add_argument("--spec-draft-tokens", type=int, default=defaults.draft_tokens, help="k")
    p.add_argument(
        "--spec-verify-cost",
        type=float,
        default=None,
        help="a step with every row drafting / a plain one (default: priced by the profile)",
    )
    p.add_argument(
        "--spec-alpha-concentration",
        type=float,
        default=defaults.alpha_concentration,
        help="Beta concentration of the requests' acceptances around the mean",
    )
    p.add_argument("--length-aware", action="store_true", help="longest expected first")
    p.add_argument("--length-noise-sigma", type=float, default=TailPolicy().length_noise_sigma)
    p.add_argument("--epoch-steps", type=int, default=None, help="steps an epoch (history)")
    p.add_argument("--systems", default=None, help="comma-separated names (default: all)")


def tail_policy(args: argparse.Namespace) -> TailPolicy:
    spec = None
    if args.speculation:
        spec = SpeculationModel(
            draft_tokens=args.spec_draft_tokens,
            alpha=args.spec_alpha,
            alpha_concentration=args.spec_alpha_concentration,
            verify_cost=args.spec_verify_cost,
        )
    return TailPolicy(
        speculation=spec,
        length_aware=args.length_aware,
        epoch_steps=args.epoch_steps,
        length_noise_sigma=args.length_noise_sigma,
    )


def chosen_systems(names: str | None) -> tuple[SystemSpec, ...]:
    if names is None:
        return SYSTEMS
    known = {s.name: s for s in SYSTEMS}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"simulate: unknown systems {unknown}; known: {sorted(known)}")
    return tuple(known[n] for n in wanted)


def multi_turn(args: argparse.Namespace) -> dict:
    """The workload's multi-turn options (none for a single-turn run: it is as it was)."""
    if args.turns == 1:
        return {}
    return {
        "turns": args.turns,
        "env_latency_s": args.env_latency_s,
        "observation_tokens": args.observation_tokens,
        "turn_median_tokens": args.turn_tokens,
    }


def print_table(result: dict) -> None:
    head = f"{'system':22s} {'tok/s':>8s} {'tok/$':>9s} {'step s':>7s} {'$/h':>7s} {'steps':>5s}"
    print(f"{head} {'pool':>5s} {'idle':>5s}")
    for name, s in result["systems"].items():
        idle = s["pool_idle_frac"]
        print(
            f"{name:22s} {s['throughput_tok_s']:8.0f} {s['tokens_per_dollar']:9.0f} "
            f"{s['mean_step_s'] or 0:7.0f} {s['cost_per_h']:7.1f} {s['steps']:5d} "
            f"{s['mean_pool_instances']:5.1f} {'-' if idle is None else f'{idle:5.2f}':>5s}"
        )
    top = result["ceiling_throughput_tok_s"]
    shares = ", ".join(f"{n} {s['ceiling_share']:.2f}" for n, s in result["systems"].items())
    print(f"ceiling of the trace: {top:.0f} tok/s; shares: {shares}")
    for k in (1, 2):
        ratio = result[f"async_k{k}_vs_hybrid_throughput"]
        cost = result[f"async_k{k}_vs_hybrid_cost_efficiency"]
        if ratio and cost:
            print(f"hybrid-async-k{k} vs hybrid: throughput {ratio:.3f}x, tokens/$ {cost:.3f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    scenario = SCENARIOS[args.scenario]()
    if args.notice_s is not None:
        scenario = replace(scenario, cloud=replace(scenario.cloud, notice_s=args.notice_s))
    if args.profile:
        scenario = replace(scenario, spot_engine=EngineProfile.load(args.profile))
    scenario = replace(scenario.with_workload(**multi_turn(args)), tail=tail_policy(args))
    targets = worker_targets(trace, 1.0, args.max_spot, args.hours, args.start_hours * 3600)
    began = time.monotonic()
    systems = chosen_systems(args.systems)
    comparison = compare(scenario, targets, args.hours * 3600, args.seed, systems)
    result = comparison.result()
    result |= {
        "trace": args.trace.name,
        "hours": args.hours,
        "start_hours": args.start_hours,
        "max_spot": args.max_spot,
        "seed": args.seed,
        **multi_turn(args),
        "wall_s": round(time.monotonic() - began, 1),
    }
    print_table(result)
    if args.plot:
        plot_throughput(comparison, args.plot, f"{scenario.name} on {args.trace.name}")
        print(f"plot: {args.plot}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

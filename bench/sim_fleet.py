"""The simulator at fleet scale (issue 22): reserved-only, hybrid, and hybrid with peer-to-peer
weight fan-out, at 16, 64 and 256 spot instances on one trace (counts scaled to each size),
with the deployment scaled alongside (services/sim/fleet.py; docs/simulation.md, "Fleet scale").

    .venv/bin/python bench/sim_fleet.py --trace ../shared/traces/FILE.csv
        [--fleet 16,64,256] [--nodes R] [--hours 2] [--start-hours 0] [--shard-nodes 2]
        [--systems reserved-only,hybrid,hybrid-p2p] [--scenario paper-14b|artifact-8b] [--seed 0]
        [--remote-share 0.5] [--cross-region-gbps 2] [--egress-usd-per-gb 0.02] [--delta-share 0.05]
        [--adapter-share 0.0187] [--lora-decode-factor 1.0]

`--nodes R` holds the trainer at R reserved nodes and the batch at R x 128 prompts (default:
N / 8 nodes for N instances, the batch growing with the fleet). `--shard-nodes` sets the nodes
a simulated shard holds (R: the whole fleet, no shards). The systems named `-xr` start
`--remote-share` of their spot instances in another region than the weight store, reached
through one link of `--cross-region-gbps` billed `--egress-usd-per-gb`; those named `-delta`
pull a version as a sparse delta of `--delta-share` of its bytes when they hold the one before
(issue 42; docs/simulation.md, "Cross-region pools and sparse deltas"). Those named `-lora`
train a LoRA adapter: an instance pulls the base once at its boot, then each version's adapter
of `--adapter-share` of the model's bytes, and decodes at `--lora-decode-factor` of the merged
speed (issue 51; docs/simulation.md, "LoRA adapters").

Prints a table, then as its LAST line a JSON object: `fleets` (instances -> `systems`, name ->
`mean_step_s`, `throughput_tok_s`, `tokens_per_dollar`, `cost_per_h`, `mean_pull_s`,
`max_pull_s`, `pulled_gb`, `mean_trainer_s`, `mean_pool_instances`, `throughput_vs_first`,
`cost_efficiency_vs_first` (against reserved-only), token accounting, ...), and the settings.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from services.infra.traces import TraceError, load_trace
from services.sim.fleet import (
    FLEET_SIZES,
    FLEET_SYSTEM_CHOICES,
    FLEET_SYSTEMS,
    SHARD_NODES,
    CrossRegion,
    FleetShape,
    LoraAdapters,
    run_fleet,
)
from services.sim.scenario import SCENARIOS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, type=Path, help="CSV `seconds,available`")
    p.add_argument("--fleet", default=",".join(map(str, FLEET_SIZES)), help="instance counts")
    p.add_argument("--nodes", type=int, help="reserved nodes (default: one per 8 instances)")
    p.add_argument("--hours", type=float, default=2.0, help="hours of the trace to simulate")
    p.add_argument("--start-hours", type=float, default=0.0, help="where in the trace to start")
    p.add_argument("--shard-nodes", type=int, default=SHARD_NODES, help="reserved nodes a shard")
    p.add_argument(
        "--systems",
        default=",".join(fs.name for fs in FLEET_SYSTEMS),
        help=f"the first is the baseline; of {', '.join(FLEET_SYSTEM_CHOICES)}",
    )
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="paper-14b")
    p.add_argument("--seed", type=int, default=0)
    xr = CrossRegion()
    p.add_argument("--remote-share", type=float, default=xr.remote_share, help="-xr systems")
    p.add_argument(
        "--cross-region-gbps", type=float, default=xr.link_bytes_per_s * 8 / 1e9, help="the link"
    )
    p.add_argument("--egress-usd-per-gb", type=float, default=xr.egress_usd_per_gb)
    p.add_argument(
        "--delta-share", type=float, default=xr.delta_share, help="-delta systems: bytes ratio"
    )
    lora = LoraAdapters()
    p.add_argument(
        "--adapter-share", type=float, default=lora.adapter_share, help="-lora: bytes ratio"
    )
    p.add_argument(
        "--lora-decode-factor",
        type=float,
        default=lora.decode_factor,
        help="-lora: decode speed unmerged over merged",
    )
    args = p.parse_args(argv)
    if not (0 < args.adapter_share <= 1 and args.lora_decode_factor > 0):
        p.error("--adapter-share must be in (0, 1], --lora-decode-factor > 0")
    args.lora = LoraAdapters(args.adapter_share, args.lora_decode_factor)
    if not (0 <= args.remote_share <= 1 and 0 < args.delta_share <= 1):
        p.error("--remote-share must be in [0, 1], --delta-share in (0, 1]")
    if args.cross_region_gbps <= 0 or args.egress_usd_per_gb < 0:
        p.error("--cross-region-gbps must be > 0, --egress-usd-per-gb >= 0")
    args.cross_region = CrossRegion(
        args.remote_share,
        args.cross_region_gbps * 1e9 / 8,
        args.egress_usd_per_gb,
        args.delta_share,
    )
    try:
        args.shapes = [
            FleetShape.of(int(n), args.nodes, args.shard_nodes) for n in args.fleet.split(",")
        ]
    except ValueError as exc:
        p.error(f"--fleet/--nodes/--shard-nodes: {exc}")
    names = args.systems.split(",")
    if unknown := set(names) - set(FLEET_SYSTEM_CHOICES):
        p.error(f"--systems: unknown {sorted(unknown)}")
    args.systems = tuple(FLEET_SYSTEM_CHOICES[name] for name in names)
    if args.hours <= 0 or args.start_hours < 0:
        p.error("--hours must be > 0, --start-hours >= 0")
    return args


def print_table(fleets: dict[str, dict]) -> None:
    print(
        f"{'N':>4s} {'system':19s} {'step s':>7s} {'pull s':>7s} {'max pull':>8s} "
        f"{'train s':>7s} {'tok/s':>9s} {'x thr':>6s} {'x tok/$':>7s} {'$/h':>8s} {'pool':>6s} "
        f"{'xr GB':>7s} {'pulled GB':>9s}"
    )
    for n, fleet in fleets.items():
        for name, s in fleet["systems"].items():
            pull, top = s["mean_pull_s"], s["max_pull_s"]
            print(
                f"{n:>4s} {name:19s} {s['mean_step_s'] or 0:7.0f} "
                f"{'-' if pull is None else f'{pull:7.1f}':>7s} "
                f"{'-' if top is None else f'{top:8.1f}':>8s} {s['mean_trainer_s'] or 0:7.0f} "
                f"{s['throughput_tok_s']:9.0f} {s['throughput_vs_first'] or 0:6.2f} "
                f"{s['cost_efficiency_vs_first'] or 0:7.3f} {s['cost_per_h']:8.1f} "
                f"{s['mean_pool_instances']:6.1f} {s['cross_region_gb']:7.0f} "
                f"{s['pulled_gb']:9.0f}"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        print(f"sim_fleet: {exc}", file=sys.stderr)
        return 2
    scenario = SCENARIOS[args.scenario]()
    began = time.monotonic()
    fleets = {
        str(shape.instances): run_fleet(
            scenario,
            trace,
            shape,
            args.hours,
            args.start_hours * 3600,
            args.seed,
            args.systems,
            cross_region=args.cross_region,
            lora=args.lora,
        )
        for shape in args.shapes
    }
    print_table(fleets)
    transfer = scenario.transfer
    result = {
        "scenario": scenario.name,
        "trace": args.trace.name,
        "hours": args.hours,
        "start_hours": args.start_hours,
        "seed": args.seed,
        "weight_bytes": transfer.weight_bytes,
        "store_egress_gbit_s": transfer.store_egress_bytes_per_s * 8 / 1e9,
        "nic_gbit_s": transfer.nic_bytes_per_s * 8 / 1e9,
        "cross_region": vars(args.cross_region),  # what the -xr and -delta systems ran with
        "lora": vars(args.lora),  # what the -lora systems ran with
        "fleets": fleets,
        "wall_s": round(time.monotonic() - began, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

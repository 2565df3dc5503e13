"""The simulator at fleet scale (issue 22): 16 to 256 spot instances on a shared trace, pulling
each version through one weight store, with and without peer-to-peer fan-out.

The deployment grows as a whole: by default a fleet of N spot instances has N / 8 reserved
8xH100 nodes (`INSTANCES_PER_NODE`, the paper's case of one node and 8 instances) and every
node brings `base.workload.prompts_per_step` prompts a step (128 x 8 samples), so each instance
has the share of a step it has at 8. With a fixed batch a step of 1,024 requests gives 4 to an
instance of 256 and is the trainer's at any size. Training scales linearly with the nodes
(weak scaling: every node trains the same batch a step; the gradient reduction is assumed
hidden under the backward pass). `nodes` fixes the trainer instead, to see where more instances
per node stop shortening the step. One weight store serves every pull, whatever the size: that
is what the fleet strains.

A fleet is simulated as R / `shard_nodes` identical shards (default 2 nodes each: 16 instances
at 8 a node), each with its nodes, its share of the instances and of the batch, and the trace
scaled to its instances; its pulls count those of all shards (`TransferModel.replicas`), which
pull at the same moments. Throughput and cost are a shard's times the shards. What a shard
leaves out: balancing and fair reads across shards (a shard's tail cannot spill onto another's
instances), and a trace's granularity finer than a shard (the shards lose instances together:
correlated preemptions). `shard_nodes` = R runs the whole fleet; docs/simulation.md compares
the two at 64.

Cross-region pools and sparse deltas (issue 42): a system may start a share of its spot
instances in another region than the weight store, reached through one shared link
(`CrossRegion`, `TransferModel`), and may pull each version as a sparse delta of the one
before; the link's bytes are billed per GB on top of the instances and nodes.

LoRA (issue 51): a system may train an adapter over a frozen base (`LoraAdapters`): an instance
pulls the base once, at its boot, and then each version's adapter only, whatever it missed
(`TransferModel.pull_parts`); its engines decode at `decode_factor` of the merged speed.

Not modelled: the reserved nodes' interconnect, the gradient reduction, and any limit of the
coordinator or of Redis at 32K requests a step.
"""

import math
from dataclasses import dataclass, replace

from services.infra.traces import TracePoint, worker_targets
from services.sim.compare import summarize
from services.sim.scenario import Scenario
from services.sim.simulation import Simulation
from services.sim.systems import HYBRID, HYBRID_ALL_SPOT, RESERVED_ONLY, SystemSpec

INSTANCES_PER_NODE = 8  # spot instances a reserved node by default (the paper's case)
SHARD_NODES = 2  # reserved nodes a simulated shard holds
FLEET_SIZES = (16, 64, 256)


@dataclass(frozen=True)
class FleetShape:
    """A fleet of `instances` spot instances and `nodes` reserved nodes, simulated as
    `replicas` identical shards."""

    instances: int
    nodes: int
    replicas: int

    @classmethod
    def of(
        cls, instances: int, nodes: int | None = None, shard_nodes: int = SHARD_NODES
    ) -> "FleetShape":
        """`nodes` None: one a `INSTANCES_PER_NODE` instances."""
        if nodes is None:
            if instances % INSTANCES_PER_NODE:
                raise ValueError(f"{instances} instances: not {INSTANCES_PER_NODE} a node")
            nodes = instances // INSTANCES_PER_NODE
        shard_nodes = min(shard_nodes, nodes)
        if nodes < 1 or shard_nodes < 1 or nodes % shard_nodes:
            raise ValueError(f"{nodes} reserved nodes do not split into shards of {shard_nodes}")
        replicas = nodes // shard_nodes
        if instances % replicas:
            raise ValueError(f"{instances} instances do not split into {replicas} shards")
        return cls(instances, nodes, replicas)

    @property
    def shard_instances(self) -> int:
        return self.instances // self.replicas

    @property
    def shard_nodes(self) -> int:
        return self.nodes // self.replicas


@dataclass(frozen=True)
class FleetSystem:
    """A system of the comparison: the switches of a `SystemSpec` plus the transfer mode:
    peer-to-peer fan-out, a pool partly in another region (`CrossRegion`), and versions as
    sparse deltas or as LoRA adapters over a base (`LoraAdapters`), one or the other."""

    name: str
    system: SystemSpec
    p2p: bool = False
    cross_region: bool = False
    deltas: bool = False
    lora: bool = False

    def __post_init__(self) -> None:
        if self.deltas and self.lora:
            raise ValueError(f"{self.name}: a version is a delta or an adapter, not both")


@dataclass(frozen=True)
class CrossRegion:
    """What the systems with a cross-region pool or sparse deltas run with (issue 42)."""

    remote_share: float = 0.5  # share of the spot instances started in the remote region
    link_bytes_per_s: float = 2e9 / 8  # the link from the store's region: 2 Gbit/s
    egress_usd_per_gb: float = 0.02  # billed per GB over the link (AWS inter-region)
    delta_share: float = 0.05  # a delta's bytes over a version's (bench/delta_share.py measures)

    def transfer_changes(self, fs: FleetSystem) -> dict[str, float]:
        """The `TransferModel` fields `fs` sets besides `p2p` (none for a plain system)."""
        changes: dict[str, float] = {}
        if fs.cross_region:
            changes |= {
                "remote_share": self.remote_share,
                "cross_region_bytes_per_s": self.link_bytes_per_s,
                "egress_usd_per_gb": self.egress_usd_per_gb,
            }
        if fs.deltas:
            changes["delta_share"] = self.delta_share
        return changes


@dataclass(frozen=True)
class LoraAdapters:
    """What the LoRA systems run with (issue 51)."""

    # an adapter's bytes over the model's: r 8 on every linear layer of qwen2-236m, the adapter
    # in fp32 (bench/lora.py; docs/benchmarks.md, "LoRA"); it scales with r / the hidden size,
    # so a wider model's is smaller
    adapter_share: float = 0.0187
    # decode speed serving the adapter unmerged over merged (bench/lora.py's
    # lora_vs_merged_tok_s once measured); 1.0: as fast, a worker that merges every adapter
    decode_factor: float = 1.0

    def apply(self, sc: Scenario) -> Scenario:
        """`sc` trained as LoRA with these adapters (`Scenario.with_lora`)."""
        return sc.with_lora(self.adapter_share, self.decode_factor)


FLEET_SYSTEMS = (
    FleetSystem("reserved-only", RESERVED_ONLY),
    FleetSystem("hybrid", HYBRID),
    FleetSystem("hybrid-p2p", HYBRID, p2p=True),
)
# every instance the trace offers held, to see what the pulls cost when the pool is not sized
FLEET_SYSTEM_CHOICES = {
    fs.name: fs
    for fs in (
        *FLEET_SYSTEMS,
        FleetSystem("hybrid-all-spot", HYBRID_ALL_SPOT),
        FleetSystem("hybrid-all-spot-p2p", HYBRID_ALL_SPOT, p2p=True),
        FleetSystem("hybrid-delta", HYBRID, deltas=True),
        FleetSystem("hybrid-p2p-delta", HYBRID, p2p=True, deltas=True),
        FleetSystem("hybrid-lora", HYBRID, lora=True),
        FleetSystem("hybrid-p2p-lora", HYBRID, p2p=True, lora=True),
        FleetSystem("hybrid-xr", HYBRID, cross_region=True),
        FleetSystem("hybrid-xr-delta", HYBRID, cross_region=True, deltas=True),
        FleetSystem("hybrid-p2p-xr", HYBRID, p2p=True, cross_region=True),
        FleetSystem("hybrid-p2p-xr-delta", HYBRID, p2p=True, cross_region=True, deltas=True),
        FleetSystem("hybrid-xr-lora", HYBRID, cross_region=True, lora=True),
        FleetSystem("hybrid-p2p-xr-lora", HYBRID, p2p=True, cross_region=True, lora=True),
    )
}


def fleet_targets(
    trace: list[TracePoint], instances: int, hours: float, start_s: float = 0.0
) -> list[tuple[float, int]]:
    """The trace's counts scaled to a fleet: round(count * instances / the trace's peak)."""
    return worker_targets(trace, 1.0, instances, hours, start_s)


def fleet_scenario(base: Scenario, shape: FleetShape, p2p: bool, **transfer: float) -> Scenario:
    """The scenario of one shard: its nodes' share of the batch, training sped up linearly
    over its nodes, and a weight store (and link) shared with the other shards; `transfer`:
    other `TransferModel` fields (`CrossRegion.transfer_changes`)."""
    return replace(
        base.with_workload(prompts_per_step=base.workload.prompts_per_step * shape.shard_nodes),
        reserved_scaling=1.0,
        transfer=replace(base.transfer, p2p=p2p, replicas=shape.replicas, **transfer),
    )


# a shard's counts and rates that the fleet has `replicas` times over
FLEET_TOTALS = (
    "throughput_tok_s",
    "cost_per_h",
    "mean_pool_instances",
    "mean_n_prem_recommended",
    "tokens_trained",
    "tokens_generated",
    "tokens_lost",
    "preemptions",
    "balance_migrations_per_step",
    "requests_per_step",
    "recalls",
    "scaled_in",
)


def summarize_fleet(sim: Simulation, replicas: int) -> dict:
    """`compare.summarize` of a shard, with the fleet's totals (`FLEET_TOTALS`, times
    `replicas`) and the pull and training figures the fleet comparison reads."""
    out = summarize(sim)
    for key in FLEET_TOTALS:
        if out[key] is not None:
            out[key] *= replicas
    out["migrations"] = {cause: n * replicas for cause, n in out["migrations"].items()}
    totals, records = sim.totals, sim.records
    train_s = [r.train_s for r in records]
    last_s = sim.sc.trainer.optimizer_s + sim.sc.trainer.publish_s
    out |= {
        "pulls": totals.pulls * replicas,
        "pulled_gb": totals.pulled_bytes * replicas / 1e9,
        "mean_pull_s": totals.pull_s / totals.pulls if totals.pulls else None,
        "max_pull_s": totals.max_pull_s if totals.pulls else None,
        # the trainer's busy time a step: its floor when rollout and pulls hide under it
        "mean_trainer_s": sum(train_s) / len(train_s) + last_s if train_s else None,
    }
    return out | egress(sim, out, replicas)


def egress(sim: Simulation, out: dict, replicas: int) -> dict:
    """The link's bytes for the fleet and their bill, added to `out`'s cost: billed at the
    run's rate (bytes over the whole simulated time), as the instances are by the hour."""
    gb = sim.fleet.cross_region_bytes * replicas / 1e9
    usd_per_h = (
        gb * sim.sc.transfer.egress_usd_per_gb / (sim.clock.now / 3600) if sim.clock.now else 0.0
    )
    changes: dict = {"cross_region_gb": gb, "egress_usd_per_h": usd_per_h}
    if usd_per_h and out["cost_per_h"]:
        cost_per_h = out["cost_per_h"] + usd_per_h
        changes |= {
            "cost_per_h": cost_per_h,
            "tokens_per_dollar": out["throughput_tok_s"] * 3600 / cost_per_h,
        }
    return changes


def ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x and y and math.isfinite(x / y) else None


def run_fleet(
    base: Scenario,
    trace: list[TracePoint],
    shape: FleetShape,
    hours: float,
    start_s: float = 0.0,
    seed: int = 0,
    systems: tuple[FleetSystem, ...] = FLEET_SYSTEMS,
    max_steps: int | None = None,
    cross_region: CrossRegion | None = None,
    lora: LoraAdapters | None = None,
) -> dict:
    """Every system on the fleet; each against the first (reserved-only by default).
    `cross_region`: what the systems with a remote pool or deltas run with; `lora`: what the
    LoRA systems run with (default their defaults)."""
    cross_region, lora = cross_region or CrossRegion(), lora or LoraAdapters()
    targets = fleet_targets(trace, shape.shard_instances, hours, start_s)
    summaries = {}
    for fs in systems:
        sc = fleet_scenario(base, shape, fs.p2p, **cross_region.transfer_changes(fs))
        if fs.lora:
            sc = lora.apply(sc)
        spec = replace(fs.system, reserved_nodes=fs.system.reserved_nodes * shape.shard_nodes)
        sim = Simulation(sc, spec, targets, seed, hours * 3600, max_steps).run()
        summaries[fs.name] = summarize_fleet(sim, shape.replicas)
    first = summaries[systems[0].name]
    for s in summaries.values():
        s["throughput_vs_first"] = ratio(s["throughput_tok_s"], first["throughput_tok_s"])
        s["cost_efficiency_vs_first"] = ratio(s["tokens_per_dollar"], first["tokens_per_dollar"])
    return {
        "instances": shape.instances,
        "reserved_nodes": shape.nodes,
        "shards": shape.replicas,
        "shard_instances": shape.shard_instances,
        "requests_per_step": base.workload.prompts_per_step
        * base.workload.group_size
        * shape.nodes,
        "systems": summaries,
    }

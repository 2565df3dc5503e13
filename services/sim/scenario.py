"""Everything a simulated run depends on besides the system and the trace: the model and its
engine profiles, the workload, training speed, weight transfer, the cloud's behaviour, prices.

`paper_14b()` mirrors the paper's 14B case; `artifact_8b()` the PolyRL artifact's Qwen3-8B
run, which publishes end-to-end figures to check the models against. docs/simulation.md gives
the source of every number.
"""

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from services.sim.profile import QWEN3_8B, QWEN3_14B, EngineProfile, ModelShape, roofline
from services.sim.tail import TailPolicy
from services.sim.workload import ResponseLengthModel

# One free constant, fitted once: the share of HBM bandwidth a serving engine reaches, chosen so
# that the veRL-like baseline of `artifact_8b()` makes the artifact's ~10,000 tokens/s.
BANDWIDTH_EFFICIENCY = 0.75

# where a pull's bytes come from: the store (its region), the cross-region link, or the remote
# region's peers that already hold the version (P2P)
Route = Literal["store", "link", "peers"]
# what a pull moves: a whole version, its sparse delta, or under LoRA the base model (the frozen
# weights every adapter applies to) and a version's adapter
Payload = Literal["whole", "delta", "base", "adapter"]


@dataclass(frozen=True)
class TrainerModel:
    """GRPO training on the reserved node: actor forward+backward with activation
    recomputation (8 x params FLOPs per token) plus the old-policy and reference log-probs
    (2 x params each), at `mfu` of the node's bf16 FLOP/s."""

    params: float
    gpus: int = 8
    gpu_flops: float = 989e12
    # 0.35: what FSDP2/Megatron trainers report at 1B+ (verl, prime-rl, slime: 35-50%). Ours,
    # measured (docs/benchmarks.md, "The trainer alone"): a 0.6B Qwen2 shape before issue 20
    # made 4.5% (fp32, one H100); after it, on one H200, 39-39.5% with bf16 autocast, chunked
    # log-probs, compiled decoder layers and micro-batches of 32 sequences (28.8% at 8, 17-22%
    # eager at 8); N ranks on GPUs not measured.
    mfu: float = 0.35
    optimizer_s: float = 8.0  # optimizer step, after the last micro-batch
    publish_s: float = 6.0  # export + commit of the new version to the weight store

    @property
    def tokens_per_s(self) -> float:
        return self.gpus * self.gpu_flops * self.mfu / (12 * self.params)


@dataclass(frozen=True)
class TransferModel:
    """Weight pulls of a new version, W = `weight_bytes`, by the instances that pull at once.

    Store only (`p2p` False): the k-th pull under way gets the slower of its NIC and a k-th of
    the store's egress E: W / min(nic, E / k) + `load_s` (every instance pulls a new version at
    the same moment, so the last of n waits n W / E).

    Peer-to-peer fan-out (`p2p` True): a puller fetches blocks from the store and from the other
    pullers at once, and serves the blocks it has verified (checkpoint-engine's P2P mode,
    INTELLECT-2's shardcast, Laminar's relays). n pullers in a swarm all finish at about

        T(n) = max(W / nic, W / E, n W / (E + n U)) + ceil(log2 n) * block / min(nic, U) + load

    with U = `peer_upload_bytes_per_s` (default the NIC; full duplex). The max is the minimum
    distribution time of a file to n peers (Kumar and Ross, "Peer-assisted file distribution:
    the minimum distribution time", 2006): every puller downloads W through its NIC; the store
    sends every byte at least once; and the n W bytes downloaded in all are uploaded by the
    store or by a puller, E + n U bytes a second together. A swarm that forwards a block as soon
    as it has it reaches that bound up to the pipeline's fill: a block reaches the last puller
    after about log2 n relays of `block_bytes` each. With U >= nic the third term never exceeds
    W / nic, so T(n) grows only by that relay term; with a smaller U it rises towards W / U and
    stops there. A puller fetches from the store alone where that is faster (while the store
    feeds every NIC, n <= E / nic, the relays only add their fill), so a pull takes the smaller
    of T(n) and the store-only time: never more, and the same for one puller.

    The k-th pull under way is timed with n = k, as store-only pulls are, with n counting the
    pulls of every shard when a fleet is simulated as `replicas` identical shards
    (services/sim/fleet.py): they share one store and pull at the same moments.

    Sparse deltas (issue 42, `delta_share` set): a puller that holds the version just before
    moves only the delta, `delta_share` W; one that holds nothing (a boot) or an older version
    moves the whole version (the store keeps every version whole besides its delta, so no chain
    of deltas is replayed). Every formula above then runs with that size in place of W.

    LoRA versions (issue 51, `adapter_share` set): a version is the base model, which never
    changes, plus an adapter of `adapter_share` W, whole by itself. A puller that holds no
    version (a boot: a new instance holds nothing) moves the base, then the adapter; one that
    holds any version has the base and moves only the adapter, whether or not it missed a
    version. Each part is timed as above with its size, one after the other, and loaded once.

    A cross-region pool (issue 42, `remote_share` > 0): that share of the spot instances starts
    in another region than the store, which it reaches through one link of
    `cross_region_bytes_per_s` shared by every pull of that region (all shards). A remote pull
    is timed as above with the link in place of the store's egress, min(link, egress), and n
    counting the remote pulls only; a home pull counts the home pulls only (the link's stream,
    a few Gbit/s, is not taken from the store's egress). With P2P the remote pullers form their
    own swarm, so the link carries each version (whole, its delta, its adapter) once: the first
    remote pull of it carries its bytes, the later ones take them from their peers; and a
    remote pull of a version its region already holds (a joiner) takes it from the peers that
    hold it (the source is a peer's upload, nothing crosses the link). The LoRA base crosses
    once a run, and a joiner takes it from any peer of its region (every version has it).
    Without P2P every remote pull crosses the link with its bytes. `egress_usd_per_gb` prices
    the bytes that cross.
    """

    weight_bytes: float
    store_egress_bytes_per_s: float = 25e9  # 200 Gbit/s from the trainer node (artifact)
    nic_bytes_per_s: float = 12.5e9  # 100 Gbit/s per spot instance
    load_s: float = 2.0
    p2p: bool = False  # pullers serve verified blocks to each other (a swarm), see above
    peer_upload_bytes_per_s: float | None = None  # what a peer uploads; None: the NIC
    block_bytes: float = 64e6  # the unit a peer relays once it has verified it
    replicas: int = 1  # identical shards pulling from this store at the same moments
    delta_share: float | None = None  # a delta's bytes over the version's; None: no deltas
    adapter_share: float | None = None  # LoRA: an adapter's bytes over W; None: full weights
    remote_share: float = 0.0  # share of the spot instances started in the remote region
    cross_region_bytes_per_s: float = 2e9 / 8  # the link to the remote region: 2 Gbit/s
    egress_usd_per_gb: float = 0.02  # what a GB over the link is billed (AWS inter-region)

    def __post_init__(self) -> None:
        if self.delta_share is not None and self.adapter_share is not None:
            raise ValueError("a version is a delta or an adapter: set delta_share or adapter_share")

    def pull_parts(
        self, holds_previous: bool, holds_base: bool = False
    ) -> tuple[tuple[Payload, float], ...]:
        """What a pull moves, part by part, (payload, bytes): under LoRA the base if the puller
        holds no version (`holds_base` False), then the adapter; with deltas on, the delta if
        it holds the version before; else the whole version."""
        w = self.weight_bytes
        if self.adapter_share is not None:
            adapter: tuple[Payload, float] = ("adapter", self.adapter_share * w)
            return (adapter,) if holds_base else (("base", w), adapter)
        if holds_previous and self.delta_share is not None:
            return (("delta", self.delta_share * w),)
        return (("whole", w),)

    def pull_bytes(self, holds_previous: bool, holds_base: bool = False) -> float:
        """What a pull moves in all (`pull_parts`)."""
        return sum(size for _, size in self.pull_parts(holds_previous, holds_base))

    def pull_s(
        self,
        concurrent: int,
        holds_previous: bool = False,
        route: Route = "store",
        holds_base: bool = False,
    ) -> float:
        """The k-th pull under way (k = `concurrent`, counting the pulls of its region) by
        `route`: from the store's region, over the link, or from the remote region's peers;
        every part by that route, then the load."""
        parts = self.pull_parts(holds_previous, holds_base)
        return sum(self.move_s(concurrent, size, route) for _, size in parts) + self.load_s

    def move_s(self, concurrent: int, size: float, route: Route = "store") -> float:
        """Seconds the k-th pull under way (k = `concurrent`) takes to move `size` bytes by
        `route`, without the load."""
        n = max(1, concurrent * self.replicas)
        source = self.store_egress_bytes_per_s
        if route == "link":
            source = min(self.cross_region_bytes_per_s, source)
        elif route == "peers":
            source = self.upload_bytes_per_s
        rate = min(self.nic_bytes_per_s, source / n)
        seconds = size / rate
        if self.p2p:
            seconds = min(seconds, self.swarm_s(n, size, source))
        return seconds

    def swarm_s(self, n: int, size: float | None = None, source: float | None = None) -> float:
        """Seconds for n concurrent pullers to receive `size` bytes (default W) by peer-to-peer
        fan-out from a `source` (default the store's egress)."""
        w = self.weight_bytes if size is None else size
        store = self.store_egress_bytes_per_s if source is None else source
        nic, upload = self.nic_bytes_per_s, self.upload_bytes_per_s
        bound = max(w / nic, w / store, n * w / (store + n * upload))
        relays = math.ceil(math.log2(n)) if n > 1 else 0
        return bound + relays * self.block_bytes / min(nic, upload)

    @property
    def upload_bytes_per_s(self) -> float:
        """What a peer uploads."""
        if self.peer_upload_bytes_per_s is None:
            return self.nic_bytes_per_s
        return self.peer_upload_bytes_per_s

    def link_bytes(self, size: float, first: bool) -> float:
        """What a remote pull's part of `size` bytes carries over the link, in one shard:
        without P2P its bytes; with it, the `first` remote pull of that part (a version whole,
        its delta, its adapter; the base) carries it for every shard (a `replicas`-th of it
        each), the later ones take it from their peers."""
        if not self.p2p:
            return size
        return size / self.replicas if first else 0.0

    def starts_remote(self, index: int) -> bool:
        """Whether the `index`-th spot instance started lives in the remote region: spread
        evenly, `remote_share` of any run of starts (index 1 of every 2 at 0.5)."""
        share = self.remote_share
        return math.floor((index + 1) * share) > math.floor(index * share)


@dataclass(frozen=True)
class CloudModel:
    """Spot instances and prices."""

    startup_s: float = 90.0  # VM boot + engine start before the first weight pull
    notice_s: float = 0.0  # preemption notice (0: none, as the trace's instant changes; GCP 30)
    heartbeat_ttl_s: float = 3.0  # a killed instance is noticed this long after it dies
    reserved_node_per_h: float = 83.79  # on-demand 8xH100 node (paper's artifact)
    spot_instance_per_h: float = 5.32  # spot 2xH100 instance ($21.28/h per 8 GPUs, artifact)
    ondemand_instance_per_h: float = 83.79 / 4  # on-demand 2xH100 (Disagg.BAL's pool)


@dataclass(frozen=True)
class Scenario:
    name: str
    model: ModelShape
    spot_engine: EngineProfile  # one engine per spot instance (2 GPUs, tensor parallel 2)
    reserved_engine: EngineProfile  # the reserved node's engines share memory with training
    reserved_engines: int  # engines on the reserved node (8 GPUs / tensor parallel 2)
    workload: ResponseLengthModel
    trainer: TrainerModel
    transfer: TransferModel
    cloud: CloudModel = field(default_factory=CloudModel)
    resume_s: float = 4.0  # reserved node, training -> rollout: weights resharded on the GPUs
    switch_s: float = 12.0  # reserved node, rollout -> training: free KV cache, reload optimizer
    reserved_scaling: float = 0.9  # training speed-up per doubling of reserved nodes, / 2
    flush_tokens: int = 16  # tokens between a worker's flushes: a kill loses at most these
    initial_t_seed_s: float = 30.0
    seeding_eta: float = 2.0
    # the long tail: speculation, length-aware dispatch (tail.py); off by default
    tail: TailPolicy = field(default_factory=TailPolicy)

    def with_workload(self, **changes) -> "Scenario":
        return replace(self, workload=replace(self.workload, **changes))

    def with_lora(self, adapter_share: float, decode_factor: float = 1.0) -> "Scenario":
        """This run trained as LoRA: each version an adapter of `adapter_share` of the model's
        bytes over a base pulled once an instance (`TransferModel`), and every engine, spot and
        reserved, serving it unmerged at `decode_factor` of the merged decode speed (a rollout
        worker's `max_loras` > 0; 1.0: as fast, a worker that merges each adapter)."""
        return replace(
            self,
            transfer=replace(self.transfer, adapter_share=adapter_share),
            spot_engine=self.spot_engine.decoding_at(decode_factor),
            reserved_engine=self.reserved_engine.decoding_at(decode_factor),
        )


def from_model(name: str, model: ModelShape, workload: ResponseLengthModel) -> Scenario:
    spot = roofline(model, memory_utilization=0.9, bandwidth_efficiency=BANDWIDTH_EFFICIENCY)
    # veRL-style co-location keeps training state resident: the engines get 60% of memory.
    reserved = roofline(model, memory_utilization=0.6, bandwidth_efficiency=BANDWIDTH_EFFICIENCY)
    return Scenario(
        name=name,
        model=model,
        spot_engine=spot,
        reserved_engine=reserved,
        reserved_engines=4,
        workload=workload,
        trainer=TrainerModel(params=model.params),
        transfer=TransferModel(weight_bytes=model.weight_bytes),
    )


def paper_14b() -> Scenario:
    """Qwen3-14B, 128 prompts x 8 samples, responses up to 14,336 tokens, one 8xH100 node."""
    return from_model("paper-14b", QWEN3_14B, ResponseLengthModel())


def artifact_8b() -> Scenario:
    """The PolyRL artifact's run: Qwen3-8B on OpenR1, same batch and length cap."""
    return from_model("artifact-8b", QWEN3_8B, ResponseLengthModel())


SCENARIOS = {"paper-14b": paper_14b, "artifact-8b": artifact_8b}

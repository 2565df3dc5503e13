"""Engine throughput profile: how long one decode step of one engine instance takes, as a table
over batch size and mean context length, as the paper's balancer profiles its engines.

The table is the replaceable part: `EngineProfile.load(path)` reads a measured one (JSON with
`batch`, `context`, `step_ms` rows by batch, `prefill_tokens_per_s`, `kv_capacity_tokens`,
`max_seqs`). `roofline(...)` builds the default from first principles for a dense transformer
served with tensor parallelism: every decode step reads all weights once and the KV cache of
every running request once (memory bound), plus matrix work that grows with the batch:

    step_s = overhead_s + (weight_bytes + batch * context * kv_bytes_per_token) / (hbm * eff)
             + batch * 2 * params / (flops * mfu)

Between grid points the step time is interpolated linearly in batch and context (the roofline
is linear in both, so the default table reproduces it exactly). What it does not model: the
attention FLOPs of very long contexts, speculative decoding, CUDA-graph batch buckets.
"""

import bisect
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

BATCH_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONTEXT_GRID = (256, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class ModelShape:
    """The figures of a dense decoder that decide its serving cost."""

    name: str
    params: float  # parameter count
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # bf16

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


# Shapes from the models' Hugging Face config.json files (Qwen/Qwen3-8B, Qwen/Qwen3-14B).
QWEN3_8B = ModelShape("qwen3-8b", params=8.19e9, layers=36, kv_heads=8, head_dim=128)
QWEN3_14B = ModelShape("qwen3-14b", params=14.8e9, layers=40, kv_heads=8, head_dim=128)


@dataclass(frozen=True)
class GpuShape:
    name: str
    hbm_bytes: float  # memory per GPU
    hbm_bytes_per_s: float  # memory bandwidth per GPU
    flops: float  # dense bf16 FLOP/s per GPU


H100_SXM = GpuShape("h100-sxm", hbm_bytes=80e9, hbm_bytes_per_s=3.35e12, flops=989e12)


@dataclass(frozen=True)
class EngineProfile:
    """Decode step time of one engine instance by (batch, mean context), and its limits."""

    name: str
    batch: tuple[int, ...]
    context: tuple[int, ...]
    step_ms: tuple[tuple[float, ...], ...]  # step_ms[i][j]: batch[i], context[j]
    prefill_tokens_per_s: float
    kv_capacity_tokens: int  # tokens of KV cache that fit beside the weights
    max_seqs: int  # the engine's cap on running requests (vLLM max_num_seqs)

    def step_s(self, batch: float, context: float) -> float:
        """Seconds of one decode step with `batch` running requests of mean context `context`."""
        i, wb = _bracket(self.batch, batch)
        j, wc = _bracket(self.context, context)
        row = self.step_ms
        lo = row[i][j] + (row[i][j + 1] - row[i][j]) * wc
        hi = row[i + 1][j] + (row[i + 1][j + 1] - row[i + 1][j]) * wc
        return max(1e-6, (lo + (hi - lo) * wb) / 1000.0)

    def tokens_per_s(self, batch: int, context: float) -> float:
        return batch / self.step_s(batch, context)

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def with_kv_capacity(self, tokens: int) -> "EngineProfile":
        return EngineProfile(**{**asdict(self), "kv_capacity_tokens": tokens})

    def decoding_at(self, factor: float) -> "EngineProfile":
        """This engine with every decode step taking 1 / `factor` as long (a LoRA adapter
        applied unmerged decodes at `factor` of the merged speed); prefill and limits as they
        are. A factor of 1 is this profile itself."""
        if factor == 1.0:
            return self
        if factor <= 0:
            raise ValueError(f"decode factor {factor}: must be > 0")
        step_ms = tuple(tuple(ms / factor for ms in row) for row in self.step_ms)
        return replace(self, name=f"{self.name}@decode-x{factor:g}", step_ms=step_ms)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "EngineProfile":
        raw = json.loads(Path(path).read_text())
        try:
            profile = cls(
                name=str(raw["name"]),
                batch=tuple(int(b) for b in raw["batch"]),
                context=tuple(int(c) for c in raw["context"]),
                step_ms=tuple(tuple(float(x) for x in row) for row in raw["step_ms"]),
                prefill_tokens_per_s=float(raw["prefill_tokens_per_s"]),
                kv_capacity_tokens=int(raw["kv_capacity_tokens"]),
                max_seqs=int(raw["max_seqs"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not an engine profile: {exc}") from exc
        if len(profile.batch) < 2 or len(profile.context) < 2:
            raise ValueError(f"{path}: needs at least two batch sizes and two context lengths")
        if len(profile.step_ms) != len(profile.batch) or any(
            len(row) != len(profile.context) for row in profile.step_ms
        ):
            raise ValueError(f"{path}: step_ms must have one row per batch, one column per context")
        return profile


def _bracket(grid: tuple[int, ...], x: float) -> tuple[int, float]:
    """Index i and weight w with x = grid[i] + w * (grid[i+1] - grid[i]); w may leave [0, 1]
    outside the grid (linear extrapolation)."""
    i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def roofline(
    model: ModelShape,
    gpu: GpuShape = H100_SXM,
    gpus: int = 2,
    memory_utilization: float = 0.9,
    bandwidth_efficiency: float = 0.6,
    mfu: float = 0.4,
    overhead_ms: float = 4.0,
    activation_bytes: float = 4e9,
    max_seqs: int = 256,
) -> EngineProfile:
    """The default profile of `model` on `gpus` GPUs with tensor parallelism (see module doc)."""
    bandwidth = gpus * gpu.hbm_bytes_per_s * bandwidth_efficiency
    compute = gpus * gpu.flops * mfu
    kv_bytes = model.kv_bytes_per_token

    def step_ms(batch: int, context: int) -> float:
        memory_s = (model.weight_bytes + batch * context * kv_bytes) / bandwidth
        compute_s = batch * 2 * model.params / compute
        return overhead_ms + 1000 * (memory_s + compute_s)

    free = gpus * gpu.hbm_bytes * memory_utilization - model.weight_bytes - activation_bytes
    if free <= 0:
        raise ValueError(f"{model.name} does not fit on {gpus} x {gpu.name}")
    return EngineProfile(
        name=f"{model.name}@{gpus}x{gpu.name}",
        batch=BATCH_GRID,
        context=CONTEXT_GRID,
        step_ms=tuple(tuple(step_ms(b, c) for c in CONTEXT_GRID) for b in BATCH_GRID),
        prefill_tokens_per_s=compute / (2 * model.params),
        kv_capacity_tokens=int(free / kv_bytes),
        max_seqs=max_seqs,
    )

"""The PEFT LoRA adapter format of a run's weight versions (issue 51), and merging an adapter
into its base.

A LoRA run publishes its base model as version 0 (a whole Hugging Face folder) and every later
version as an adapter only: `adapter_config.json` (peft's LoraConfig as JSON) and
`adapter_model.safetensors` (peft's saved state: `base_model.model.<module>.lora_A.weight`,
[r x in], and `...lora_B.weight`, [out x r]). peft's forward of a wrapped Linear is
W x + scaling * B (A x), so the weight it serves is W + scaling * B @ A, with scaling
lora_alpha / r (lora_alpha / sqrt(r) under rslora).

What cannot be merged exactly into plain weights is refused with a ValueError that names it
(DoRA, per-module ranks or alphas, fan-in-fan-out layers, any saved tensor that is not a
lora_A or lora_B weight: biases, embeddings, modules_to_save), never merged approximately.

Pure torch and safetensors, no peft: the worker merges without it. It reads only the base
tensors an adapter wraps (safetensors reads a tensor without the rest of its file).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_INDEX = "model.safetensors.index.json"  # a sharded base: its weight_map names each shard
PEFT_PREFIX = "base_model.model."  # before every module name peft saves
LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter read whole: its scaling and, per base weight name
    ("model.layers.0.self_attn.q_proj.weight"), its (A, B) pair."""

    scaling: float
    pairs: dict[str, tuple["torch.Tensor", "torch.Tensor"]]


def is_adapter(folder: Path) -> bool:
    """Whether `folder` holds an adapter (rather than whole weights)."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def scaling_of(config: dict[str, Any]) -> float:
    """The factor of B @ A in the merged weight, from an adapter_config.json; a ValueError
    for what no single factor merges exactly."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter of type {config.get('peft_type')!r}: only LORA is merged")
    for flag in ("use_dora", "fan_in_fan_out", "lora_bias"):
        if config.get(flag):
            raise ValueError(f"adapter with {flag}: cannot be merged here")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            raise ValueError(f"adapter with a {pattern} ({config[pattern]}): not merged here")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ValueError(f"adapter r {r!r}: a positive integer is needed")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"adapter lora_alpha {alpha!r}: a number is needed")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def base_name(key: str) -> tuple[str, str]:
    """A saved adapter key -> (the base weight it wraps, "A" or "B"); a ValueError for a key
    that is not a lora_A or lora_B weight."""
    for suffix, which in LORA_SUFFIXES.items():
        if key.endswith(suffix):
            module = key.removesuffix(suffix).removeprefix(PEFT_PREFIX)
            return f"{module}.weight", which
    raise ValueError(f"adapter tensor {key}: not a lora_A or lora_B weight, cannot be merged")


def read_adapter(folder: Path) -> Adapter:
    """The adapter in `folder`, checked to be mergeable: every lora_A has its lora_B and the
    other way round, and each pair's ranks agree."""
    from safetensors.torch import load_file

    folder = Path(folder)
    scaling = scaling_of(json.loads((folder / ADAPTER_CONFIG).read_text()))
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(folder / ADAPTER_WEIGHTS).items():
        name, which = base_name(key)
        halves.setdefault(name, {})[which] = tensor
    pairs = {}
    for name, half in sorted(halves.items()):
        if half.keys() != {"A", "B"}:
            lacking = "lora_B" if "A" in half else "lora_A"
            raise ValueError(f"adapter of {name}: its {lacking} weight is missing")
        a, b = half["A"], half["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter of {name}: A {tuple(a.shape)} and B {tuple(b.shape)}")
        pairs[name] = (a, b)
    return Adapter(scaling, pairs)


def base_files(folder: Path) -> dict[str, str]:
    """Each tensor of a Hugging Face weights folder -> the name of the shard that holds it."""
    from safetensors import safe_open

    index = folder / BASE_INDEX
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    files: dict[str, str] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            files.update((name, shard.name) for name in f.keys())  # noqa: SIM118 (safe_open is no mapping)
    return files


def merged_tensors(base_folder: Path, adapter_folder: Path) -> dict[str, "torch.Tensor"]:
    """Each weight the adapter wraps, merged: base + scaling * B @ A, computed in float32 and
    returned in the base tensor's dtype. Only those base tensors are read. A weight the base
    lacks, or whose shape is not B @ A's, is a ValueError naming it."""
    import torch
    from safetensors import safe_open

    base_folder = Path(base_folder)
    adapter = read_adapter(adapter_folder)
    files = base_files(base_folder)
    missing = sorted(adapter.pairs.keys() - files.keys())
    if missing:
        raise ValueError(f"adapter wraps weights that the base in {base_folder} lacks: {missing}")
    by_shard: dict[str, list[str]] = {}
    for name in adapter.pairs:
        by_shard.setdefault(files[name], []).append(name)
    merged = {}
    for shard, names in sorted(by_shard.items()):
        with safe_open(base_folder / shard, framework="pt") as f:
            for name in names:
                weight = f.get_tensor(name)
                a, b = adapter.pairs[name]
                shape = (b.shape[0], a.shape[1])
                if tuple(weight.shape) != shape:
                    raise ValueError(
                        f"{name}: base shape {tuple(weight.shape)}, adapter B @ A {shape}"
                    )
                delta = b.to(torch.float32) @ a.to(torch.float32)
                total = weight.to(torch.float32) + adapter.scaling * delta
                merged[name] = total.to(weight.dtype)
    return merged

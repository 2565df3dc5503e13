"""Reads named tensors from a Hugging Face weights folder, for loading only what changed.

A folder holds safetensors shards and, when sharded, `model.safetensors.index.json` whose
`weight_map` says which shard holds each tensor; without an index the shards' own keys say it.
`read_tensors` opens each shard once and reads only the tensors asked for (safetensors reads
a tensor without reading the rest of its file). `tensor_shapes` and `same_model` tell weights of
the model held from another model's (a worker placed on a run on another base). `whole_layers`
widens a set of changed names to every tensor of the layers they belong to, for engines that
fuse a layer's checkpoint tensors into one parameter (vLLM's qkv_proj, gate_up_proj, a MoE
layer's experts) and can only process a layer once all of it is loaded.

It knows nothing of engines or models: names are the checkpoint's, as in the safetensors files.
"""

import json
import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

INDEX = "model.safetensors.index.json"
EXPERTS = re.compile(r"^(.*\.experts)\.\d+\.")


class TensorsNotInFolder(ValueError):
    """Tensors asked for that no shard of the folder holds."""


def tensor_files(folder: Path) -> dict[str, str]:
    """Each tensor's name -> the name of the shard that holds it."""
    folder = Path(folder)
    index = folder / INDEX
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    files: dict[str, str] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            files.update((name, shard.name) for name in f.keys())  # noqa: SIM118 (safe_open is no mapping)
    return files


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's name -> its shape, from the shards' headers (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def same_model(held: dict[str, tuple[int, ...]], given: dict[str, tuple[int, ...]]) -> bool:
    """Whether the tensors `given` (a weights folder's, `tensor_shapes`) are weights of the
    model whose tensors are `held`: every one of them is held with the same shape, and every
    tensor held is given but those a checkpoint may leave out (a rotary embedding's
    frequencies, an output layer tied to the embedding). A run on another base model is not."""
    if any(held.get(name) != shape for name, shape in given.items()):
        return False
    optional = {"lm_head.weight"}
    return all(
        name in given or name in optional or name.endswith("rotary_emb.inv_freq") for name in held
    )


def read_tensors(folder: Path, names: Collection[str]) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(name, tensor on the CPU) for each of `names`, shard by shard, read as iterated.
    Raises `TensorsNotInFolder` at once, before anything is read, if a name is in no shard."""
    folder = Path(folder)
    files = tensor_files(folder)
    missing = sorted(set(names) - files.keys())
    if missing:
        raise TensorsNotInFolder(f"not in {folder}: {missing}")
    by_shard: dict[str, list[str]] = {}
    for name in sorted(names):
        by_shard.setdefault(files[name], []).append(name)
    return _read_shards(folder, by_shard)


def _read_shards(
    folder: Path, by_shard: dict[str, list[str]]
) -> Iterator[tuple[str, "torch.Tensor"]]:
    from safetensors import safe_open

    for shard, shard_names in sorted(by_shard.items()):
        with safe_open(folder / shard, framework="pt") as f:
            for name in shard_names:
                yield name, f.get_tensor(name)


def layer_of(name: str) -> str:
    """The layer a checkpoint tensor belongs to: its name less the projection and the
    parameter ("model.layers.3.self_attn.q_proj.weight" -> "model.layers.3.self_attn"), and
    for a MoE expert the whole experts module ("...mlp.experts.7.up_proj.weight" ->
    "...mlp.experts")."""
    experts = EXPERTS.match(name)
    if experts:
        return experts.group(1)
    return name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""


def whole_layers(changed: Collection[str], names: Collection[str]) -> set[str]:
    """The names among `names` (all of a folder's) of every layer a changed name belongs to:
    what an engine that fuses a layer's tensors must load for `changed` to be loaded whole."""
    layers = {layer_of(n) for n in changed}
    return {n for n in names if layer_of(n) in layers} | set(changed)

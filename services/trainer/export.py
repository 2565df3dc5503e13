"""A policy's weights as the files of a Hugging Face folder, made in memory: safetensors shards
(and their index when there are several) in the published dtype, beside the model folder's
other files (config with that dtype, tokenizer, generation config).

A version is uploaded from these bytes straight away: nothing is written to disk and read back
on the way to the weight store. `write_files` puts them in a folder where one is wanted.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARD_BYTES = 1 << 30
SINGLE = "model.safetensors"


def shard(tensors: dict[str, torch.Tensor], limit: int = SHARD_BYTES) -> list[dict]:
    """Consecutive tensors grouped into shards of at most `limit` bytes (a bigger tensor is a
    shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def weight_files(tensors: dict[str, torch.Tensor], limit: int = SHARD_BYTES) -> dict[str, bytes]:
    """The safetensors files of `tensors`: one `model.safetensors`, or numbered shards and
    `model.safetensors.index.json`."""
    shards = shard(tensors, limit)
    if len(shards) == 1:
        return {SINGLE: save(shards[0], metadata={"format": "pt"})}
    files, weight_map = {}, {}
    for i, part in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        files[name] = save(part, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    return files


def companion_files(model_dir: Path, dtype_name: str) -> dict[str, bytes]:
    """The model folder's files other than its weights, the config naming `dtype_name`."""
    files = {
        src.name: src.read_bytes()
        for src in sorted(Path(model_dir).iterdir())
        if src.is_file() and not src.name.startswith("model") and src.suffix != ".safetensors"
    }
    config = json.loads(files["config.json"])
    config["torch_dtype"] = config["dtype"] = dtype_name
    files["config.json"] = json.dumps(config, indent=2).encode()
    return files


def write_files(files: dict[str, bytes], folder: Path) -> Path:
    """`files` as a folder of their own (what was there is replaced)."""
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def read_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load a version's safetensors files (a folder `write_files` wrote, any dtype) into the
    model, each tensor in the dtype and on the device of the model's own."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(path))
    own = model.state_dict()
    model.load_state_dict(
        {k: v.to(own[k].device, own[k].dtype) for k, v in tensors.items()}, strict=True
    )

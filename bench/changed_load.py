"""What loading only the changed tensors saves over reloading the whole folder, per engine.

One model (`--hidden`, `--layers`, fp32), and a second version where only one decoder layer's
tensors moved (a sparse delta's share: 1/layers of the layers). Each engine loads v1, then
alternately the whole v2 folder (`load(folder)`) and v2 with `changed` (`load(folder, changed)`)
back and forth with v1, `--repeats` times; median seconds of each.

Prints one JSON object as its LAST line.

    .venv/bin/python bench/changed_load.py [--hidden 1024 --layers 8 --repeats 3]
"""

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import repo_root  # noqa: F401  (the repository on sys.path)


def build_versions(root: Path, hidden: int, layers: int) -> tuple[Path, Path, frozenset[str]]:
    from safetensors.torch import load_file, save_file

    from services.trainer.init_model import InitModelSpec, init_model

    spec = InitModelSpec(hidden_size=hidden, layers=layers, heads=hidden // 64, pretrain_steps=0)
    v1 = init_model(root / "v1", spec)
    v2 = root / "v2"
    v2.mkdir()
    for f in v1.iterdir():
        if f.suffix != ".safetensors":
            (v2 / f.name).write_bytes(f.read_bytes())
    state = load_file(v1 / "model.safetensors")
    changed = frozenset(n for n in state if n.startswith(f"model.layers.{layers // 2}."))
    for n in changed:
        state[n] = state[n] + 0.01
    save_file(state, v2 / "model.safetensors")
    return v1, v2, changed


async def time_engine(engine, v1: Path, v2: Path, changed: frozenset[str], repeats: int):
    async def timed(folder, names=None) -> float:
        start = time.perf_counter()
        await engine.load(folder, names)
        return time.perf_counter() - start

    await engine.load(v1)
    whole, only = [], []
    for _ in range(repeats):
        whole.append(await timed(v2))
        await engine.load(v1, changed)
        only.append(await timed(v2, changed))
        await engine.load(v1, changed)
    await engine.close()
    return statistics.median(whole), statistics.median(only)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-vllm", action="store_true")
    a = p.parse_args()
    from services.rollout.engines.hf import HFEngine

    with tempfile.TemporaryDirectory() as tmp:
        v1, v2, changed = build_versions(Path(tmp), a.hidden, a.layers)
        size = sum(f.stat().st_size for f in v1.glob("*.safetensors"))
        out = {"hidden": a.hidden, "layers": a.layers, "changed_tensors": len(changed)}
        out["folder_mib"] = round(size / 2**20, 1)
        hf = asyncio.run(time_engine(HFEngine(), v1, v2, changed, a.repeats))
        out["hf_whole_s"], out["hf_changed_s"] = round(hf[0], 4), round(hf[1], 4)
        if not a.no_vllm:
            from services.rollout.engines.vllm import VLLMEngine, VLLMOptions

            engine = VLLMEngine(VLLMOptions(slots=4, dtype="float32", kv_cache_gib=0.25))
            vl = asyncio.run(time_engine(engine, v1, v2, changed, a.repeats))
            out["vllm_whole_s"], out["vllm_changed_s"] = round(vl[0], 4), round(vl[1], 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

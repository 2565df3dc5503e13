"""A LoRA version's load into the transformers engine against a full version's, on one device
(issue 54: on a GPU, where a full load moves the whole model over the host link).

It builds a random model of one of bench/trainer.py's shapes, and from it the trainer's own
exports (`Policy.export_files` with `lora_r`): version 0, the whole model in the published dtype
(what a full-weight run ships every version), and version 1, the PEFT adapter alone (what a
LoRA run ships). An `HFEngine` on `--device` loads version 0 once (`cold_s`: the model built
from the folder and moved to the device), then, alternately `--rounds` times:
- `full_load_s`: version 0's folder loaded again over the weights held (`load_weights`: every
  tensor read, converted and copied in place), as a worker serves a full version;
- `adapter_load_s`: version 1's adapter held as a new adapter version (`hold_adapter`), as a
  worker serves a LoRA version: requests added from then on generate with it.
Each time is the median over rounds, the device synchronized before and after. Prints one JSON
object as its LAST line: the times, `full_vs_adapter` (full_load_s / adapter_load_s), the
folders' bytes, the device's name.

    .venv/bin/python bench/adapter_load.py                               # small shape, CPU
    python3 bench/adapter_load.py --shape qwen2-0.6b --device cuda --lora-r 16
"""

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import repo_root  # noqa: F401  (the repository root on sys.path)


def exports(shape: str, folder: Path, lora_r: int, device: str) -> tuple[Path, Path]:
    """Version 0 (the whole model) and version 1 (the adapter) of a LoRA policy on a random
    model of `shape`, as the trainer writes them."""
    from trainer import build_model

    from services.contracts.runspec import RunSpec
    from services.trainer.policy import Policy

    build_model(folder / "random", shape)
    spec = RunSpec(
        model=str(folder / "random"),
        lora={"use_peft": True, "lora_r": lora_r, "lora_alpha": 2 * lora_r},
    )
    policy = Policy(folder / "random", spec, device)
    full = policy.export(folder / "v0", 0)
    adapter = policy.export(folder / "v1", 1)
    del policy
    return full, adapter


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def timed(device: str, work) -> float:
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    started = time.perf_counter()
    work()
    sync()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="small", help="a bench/trainer.py shape")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    from services.rollout.engines.hf import HFEngine

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        full, adapter = exports(args.shape, Path(tmp), args.lora_r, args.device)
        engine = HFEngine(args.device, max_adapters=2)
        cold = timed(args.device, lambda: engine.load_weights(full))
        full_s, adapter_s = [], []
        for round_ in range(args.rounds):
            full_s.append(timed(args.device, lambda: engine.load_weights(full)))
            hold = partial(engine.hold_adapter, round_ + 1, adapter)  # a new version each round
            adapter_s.append(timed(args.device, hold))
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
        out = {
            "device": name,
            "shape": args.shape,
            "lora_r": args.lora_r,
            "cold_s": round(cold, 4),
            "full_load_s": round(statistics.median(full_s), 4),
            "adapter_load_s": round(statistics.median(adapter_s), 4),
            "full_vs_adapter": round(statistics.median(full_s) / statistics.median(adapter_s), 1),
            "full_bytes": folder_bytes(full),
            "adapter_bytes": folder_bytes(adapter),
            "rounds": args.rounds,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

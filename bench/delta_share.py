"""How much of a version changes (issue 42): the share of elements that differ between
consecutive exported versions, bf16 and fp32, and what the sparse delta
(services/weights/delta.py) makes of it. This decides whether versions travel as deltas.

For each model and learning rate it takes `--steps` real RL steps with the trainer's own code
(`services.trainer.policy.Policy`: its GRPO loss, its AdamW over fp32 master weights as
optim.py configures it, gradient clipping at 1.0) on synthetic groups: random prompts and
responses drawn from the model's vocabulary, rewards 0/1 alternating within each group (so every
response has an advantage), rollout logprobs of -ln(vocab) (a ratio near 1). After each step it
exports the weights as the weight store receives them (`export.weight_files`, bf16 and fp32,
1 GB shards) and compares each export with the one before:
- changed_fraction: elements changed / elements, over all tensors (`delta.changed_fraction`),
  and per tensor (min, median, max over tensors);
- delta_bytes_ratio: len(encode(old, new)) / len(new), summed over the shards (bf16 every step;
  fp32 the last step only when the files pass `--fp32-delta-max-mb`: a dense fp32 delta of a big
  model costs more time and memory than this machine's budget);
- encode_s and apply_s of those deltas (apply checked byte-exact).

Models (random initialisation is the model's own, nothing is downloaded):
- `embedded`: the embedded default's base model, built as `spotrl init-model` builds it
  (InitModelSpec's defaults: a Qwen2 of hidden 128, 3 layers, a ~320-token BPE vocabulary),
  pre-trained `--pretrain-steps` on the arithmetic task, RL steps of the embedded preset's size
  (32 prompts x 8 responses of 6 tokens);
- `qwen2-236m` (the default's large model): Qwen2-0.5B's width (hidden 896, 14 heads / 2 KV
  heads, MLP 4864) with 12 of its 24 layers and a 32,000-token vocabulary, untied as the trainer
  requires: 236 M parameters, randomly initialised (transformers' Qwen2 init, std 0.02); one
  prompt x 2 responses of 8 tokens a step. Both are bench/trainer.py's SHAPES. `qwen2-0.6b`,
  Qwen2-0.5B's full shape (vocabulary 151,936, 0.63 B parameters untied), is there too, but
  with its AdamW state and two exports of each dtype in memory it was killed for memory (15 GB
  resident) on the 2-core, 24 GiB machine.

Prints per step to stderr and, as its LAST line, one JSON object: per "model/lr/dtype" the
changed_fraction (mean over steps), its per-tensor min/median/max, delta_bytes_ratio,
encode_s and apply_s.

    .venv/bin/python bench/delta_share.py [--models embedded,qwen2-236m] [--steps 4]
        [--lrs 1e-6,1e-5,1e-4]
"""

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import repo_root  # noqa: F401  (the repository root on sys.path)

STEP_SIZES = {"embedded": (32, 8, 6, 8), "qwen": (1, 2, 8, 8)}  # prompts, n, response, prompt


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def build(name: str, folder: Path, pretrain_steps: int) -> Path:
    """The model `name` as a Hugging Face folder in `folder`."""

    if name == "embedded":
        from services.trainer.init_model import InitModelSpec, init_model

        return init_model(folder, InitModelSpec(pretrain_steps=pretrain_steps))
    from trainer import build_model  # bench/trainer.py: a random Qwen2-shaped model

    build_model(folder, name)
    return folder


def groups(vocab: int, sizes: tuple[int, int, int, int], seed: int) -> list:
    from services.contracts.messages import Group, Response

    prompts, n, length, prompt_len = sizes
    rng = random.Random(seed)
    out = []
    for p in range(prompts):
        responses = [
            Response(
                token_ids=[rng.randrange(2, vocab) for _ in range(length)],
                logprobs=[-math.log(vocab)] * length,
                reward=float(i % 2),
                finish_reason="length",
            )
            for i in range(n)
        ]
        prompt_ids = [rng.randrange(2, vocab) for _ in range(prompt_len)]
        out.append(
            Group(
                run_id="b",
                step=seed,
                prompt_index=p,
                prompt_ids=prompt_ids,
                responses=responses,
            )
        )
    return out


def exports(policy) -> dict[str, dict[str, bytes]]:
    """The weights' safetensors files as the trainer publishes them, in bf16 and in fp32."""
    import torch

    from services.trainer.export import weight_files

    state = policy.model.state_dict()
    out = {}
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
        files = weight_files(tensors)
        out[dtype_name] = {k: v for k, v in files.items() if k.endswith(".safetensors")}
    return out


def compare(old: dict[str, bytes], new: dict[str, bytes], encode_it: bool) -> dict:
    """One pair of consecutive exports of one dtype, all shards."""
    from services.weights.delta import apply, encode, tensor_changes

    per_tensor: dict[str, float] = {}
    changed = elements = 0
    delta_bytes = file_bytes = 0
    encode_s = apply_s = 0.0
    for name, new_file in new.items():
        for tensor, (c, n) in tensor_changes(old[name], new_file).items():
            changed, elements = changed + c, elements + n
            if n:
                per_tensor[tensor] = c / n
        if not encode_it:
            continue
        started = time.perf_counter()
        delta = encode(old[name], new_file)
        encode_s += time.perf_counter() - started
        assert delta is not None
        started = time.perf_counter()
        assert apply(old[name], delta) == new_file
        apply_s += time.perf_counter() - started
        delta_bytes += len(delta)
        file_bytes += len(new_file)
        del delta
    row = {"changed_fraction": changed / elements, "per_tensor": per_tensor}
    if encode_it:
        row |= {
            "delta_bytes_ratio": delta_bytes / file_bytes,
            "encode_s": encode_s,
            "apply_s": apply_s,
            "file_bytes": file_bytes,
        }
    return row


def run_setting(model: str, folder: Path, lr: float, args) -> dict[str, list[dict]]:
    """`--steps` steps at `lr` from the model's initial weights; the rows of each dtype."""
    from services.contracts.runspec import RunSpec
    from services.trainer.policy import Policy

    sizes = STEP_SIZES["embedded" if model == "embedded" else "qwen"]
    spec = RunSpec(
        model=str(folder),
        prompts_per_step=sizes[0],
        group_size=sizes[1],
        max_new_tokens=sizes[2],
        learning_rate=lr,
        lr_scheduler_type="constant",
    )
    policy = Policy(folder, spec, "cpu")
    vocab = policy.model.config.vocab_size
    previous = exports(policy)
    rows: dict[str, list[dict]] = {"bf16": [], "fp32": []}
    for step in range(args.steps):
        started = time.perf_counter()
        policy.accumulate(groups(vocab, sizes, seed=step))
        policy.optimizer_step()
        step_s = time.perf_counter() - started
        current = exports(policy)
        for dtype, files in current.items():
            small = sum(map(len, files.values())) <= args.fp32_delta_max_mb << 20
            encode_it = dtype == "bf16" or (step == args.steps - 1 and small)
            row = compare(previous[dtype], files, encode_it)
            rows[dtype].append(row)
            log(
                f"{model} lr={lr:g} step {step + 1} {dtype}: changed "
                f"{row['changed_fraction']:.4%}, delta/file {row.get('delta_bytes_ratio', '-')}"
                f" (step {step_s:.1f}s)"
            )
        previous = current
        del current
    return rows


def summary(rows: list[dict]) -> dict:
    fractions = [r["changed_fraction"] for r in rows]
    tensors = [f for r in rows for f in r["per_tensor"].values()]
    out = {
        "changed_fraction": statistics.mean(fractions),
        "changed_fraction_per_step": [round(f, 6) for f in fractions],
        "tensor_min": min(tensors),
        "tensor_median": statistics.median(tensors),
        "tensor_max": max(tensors),
    }
    worst: dict[str, float] = {}
    for r in rows:
        for name, f in r["per_tensor"].items():
            worst[name] = max(worst.get(name, 0.0), f)
    out["least_changed_tensor"] = min(worst, key=worst.__getitem__)
    encoded = [r for r in rows if "delta_bytes_ratio" in r]
    if encoded:
        out["delta_bytes_ratio"] = statistics.mean(r["delta_bytes_ratio"] for r in encoded)
        out["encode_s"] = statistics.median(r["encode_s"] for r in encoded)
        out["apply_s"] = statistics.median(r["apply_s"] for r in encoded)
        out["file_mb"] = encoded[-1]["file_bytes"] / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="embedded,qwen2-236m")
    parser.add_argument("--steps", type=int, default=4, help="steps (exported pairs) a setting")
    parser.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=300,
        help="pre-training of the embedded model (spotrl up: 1000)",
    )
    parser.add_argument("--fp32-delta-max-mb", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result: dict = {"steps": args.steps, "threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            started = time.perf_counter()
            folder = build(model, Path(tmp) / model, args.pretrain_steps)
            log(f"built {model} in {time.perf_counter() - started:.0f}s")
            for lr in (float(x) for x in args.lrs.split(",")):
                for dtype, rows in run_setting(model, folder, lr, args).items():
                    result[f"{model}/{lr:g}/{dtype}"] = summary(rows)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""The trainer alone (`services.trainer.policy.Policy`): tokens per second, MFU and peak memory
of RL steps on a model of a given shape, padded micro-batches against packed ones, side by side.

It builds a Qwen2-shaped model on the spot (random weights, untied; nothing is downloaded) and
feeds the policy synthetic groups: fixed-length prompts, responses of a long-tailed length mix
(log-normal, clipped to `--max-new-tokens`), as RL rollouts are. Each variant runs in a fresh
process (its peak memory is its own), the variants alternate for `--rounds`:
- `padded`: `--micro-batch-size` sequences a pass, right-padded (the trainer's default);
- `packed`: micro-batches cut by `--tokens-per-micro-batch`, packed into one row, no padding;
- with `--fp32-too` on a GPU, `padded-fp32`: the padded variant in float32 (the trainer before
  mixed precision), for the speedup of bfloat16;
- with `--lora-r R`, `padded-lora`: the padded variant training a LoRA adapter of rank R on every
  linear layer (the trainer's peft path) instead of every weight, side by side with full
  weights; its MFU counts 4 x parameters a token (forward and the inputs' gradients: a frozen
  base has no weight gradients), `lora_mfu_6n` the full-weight convention;
- with `--unchunked-too`, `packed-unchunked`: the packed variant with every response token's
  logits at once (`logprob_chunk_tokens` past the micro-batch), for the peak memory that
  chunking saves (large with a large vocabulary: `--shape wide-vocab`).

The token budget's default (1024) is about what `--micro-batch-size` 8 sequences of the default
mix hold (32-token prompts, responses of median e^4 ~ 55 tokens, mean ~90): the two variants
take similar micro-batches. A packed row is attended with a dense block-diagonal mask here
(sdpa): its attention costs the row's length squared, so much larger budgets lose on a CPU
(2048: 1.5x over padded instead of 2x); flash-attention's variable-length kernels on a GPU do
not pay it.

Tokens counted are the sequences' own (prompt + response), never padding. MFU = 6 x parameters
x tokens/s over the device's peak (a small table by device name, or `--peak-tflops`; on a CPU
the peak is measured: a large float32 matmul's FLOP/s on this machine). Prints each round to
stderr and, as its LAST line, one JSON object: tok_s, mfu, peak_mem_gib (of the packed variant),
padding_fraction (of the padded one), packed_vs_padded (tokens/s ratio), device, ...

    .venv/bin/python bench/trainer.py                      # a small shape, CPU
    .venv/bin/python bench/trainer.py --shape qwen2-0.6b   # the issue's 0.6B shape (a GPU)
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import repo_root  # noqa: F401  (the repository root on sys.path)

SHAPES = {  # hidden, layers, heads, kv heads, MLP, vocab
    "small": (256, 4, 4, 4, 768, 4096),
    "qwen2-0.6b": (896, 24, 14, 2, 4864, 151936),
    "wide-vocab": (256, 2, 4, 4, 768, 151936),  # Qwen2's vocabulary on a small body
    "qwen2-236m": (896, 12, 14, 2, 4864, 32000),  # Qwen2-0.5B's width, half its depth, 32k vocab
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0}


def build_model(folder: Path, shape: str) -> int:
    """A random model of `shape` saved as a Hugging Face folder; its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv_heads, mlp, vocab = SHAPES[shape]
    config = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def synthetic_groups(args, vocab: int, seed: int):
    """A step's groups: B prompts of `--prompt-tokens`, n responses each of log-normal length."""
    import random

    from services.contracts.messages import Group, Response

    rng = random.Random(seed)
    groups = []
    for p in range(args.prompts_per_step):
        prompt = [rng.randrange(2, vocab) for _ in range(args.prompt_tokens)]
        responses = []
        for _ in range(args.group_size):
            length = int(min(args.max_new_tokens, max(1, rng.lognormvariate(args.mu, 1.0))))
            tokens = [rng.randrange(2, vocab) for _ in range(length)]
            responses.append(
                Response(
                    token_ids=tokens,
                    logprobs=[-1.0] * length,
                    reward=float(rng.random() < 0.5),
                    finish_reason="length",
                )
            )
        groups.append(
            Group(
                run_id="b",
                step=0,
                prompt_index=p,
                prompt_ids=prompt,
                responses=responses,
            )
        )
    return groups


def run_variant(args, variant: str) -> dict:
    """In this process: `--steps` RL steps of the policy in `variant`; what they measured."""
    import torch

    from services.contracts.runspec import RunSpec
    from services.trainer.batching import Row, cut_by_count, padded
    from services.trainer.policy import Policy

    torch.set_num_threads(args.threads)
    device = args.device
    over: dict = {"train_precision": "float32" if variant.endswith("fp32") else "auto"}
    if args.torch_compile and not variant.endswith("fp32"):
        over["torch_compile"] = True
    if variant.startswith("packed"):
        over["max_tokens_per_micro_batch"] = args.tokens_per_micro_batch
    if variant == "packed-unchunked":
        over["logprob_chunk_tokens"] = 1 << 20
    if variant.endswith("lora"):
        over["lora"] = {"use_peft": True, "lora_r": args.lora_r, "lora_alpha": 2 * args.lora_r}
    spec = RunSpec(
        model=str(args.model),
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        micro_batch_size=args.micro_batch_size,
        lr_scheduler_type="constant",
        **over,
    )
    policy = Policy(args.model, spec, device)
    vocab = policy.model.config.vocab_size
    tokens = padding = positions = 0
    seconds = []
    for step in range(args.warmup + args.steps):
        groups = synthetic_groups(args, vocab, seed=step)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        policy.accumulate(groups)
        policy.optimizer_step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if step < args.warmup:
            continue
        seconds.append(time.perf_counter() - started)
        rows = [(g.prompt_ids, r.token_ids) for g in groups for r in g.responses]
        tokens += sum(len(p) + len(r) for p, r in rows)
        if variant.startswith("padded"):  # the padding the trainer's padded layout carries
            all_rows = [Row(p, r, [0.0] * len(r), 0.0) for p, r in rows]
            for rows_of_batch in cut_by_count(all_rows, args.micro_batch_size, final=True)[0]:
                batch = padded(rows_of_batch, 0)
                padding += batch.padding_tokens
                positions += batch.input_ids.numel()
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    return {
        "tok_s": tokens / sum(seconds),
        "step_s": statistics.median(seconds),
        "peak_mem_gib": peak,
        "padding_fraction": padding / positions if positions else 0.0,
    }


def cpu_peak_tflops(threads: int) -> float:
    """float32 matmul FLOP/s on this machine with `threads` threads (the CPU's practical peak)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(3):
        a @ b
    started, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    return 2 * 2048**3 * reps / (time.perf_counter() - started) / 1e12


def device_peak(args) -> tuple[str, float]:
    """The device's name and its peak TFLOP/s (bfloat16 on a GPU, measured float32 on a CPU)."""
    if args.peak_tflops:
        return args.device, args.peak_tflops
    if args.device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name()
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return name, tflops
        raise SystemExit(f"no peak FLOP/s known for {name}: pass --peak-tflops")
    return f"cpu x{args.threads}", cpu_peak_tflops(args.threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--mu", type=float, default=4.0, help="log-normal mu of response lengths")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--tokens-per-micro-batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fp32-too", action="store_true")
    parser.add_argument("--unchunked-too", action="store_true")
    parser.add_argument("--lora-r", type=int, default=None, help="also padded-lora, this rank")
    parser.add_argument(
        "--torch-compile", action="store_true", help="torch_compile the bfloat16/auto variants"
    )
    parser.add_argument(
        "--only", default=None, help="comma-separated variants to run (default: all asked for)"
    )
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()

    if args.variant is not None:
        print(json.dumps(run_variant(args, args.variant)))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    if args.model is None:
        args.model = work / "model"
    params = build_model(args.model, args.shape)
    variants = ["padded", "packed"] + (["padded-fp32"] if args.fp32_too else [])
    variants += ["packed-unchunked"] if args.unchunked_too else []
    variants += ["padded-lora"] if args.lora_r else []
    if args.only:
        variants = [v for v in variants if v in args.only.split(",")]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for round_ in range(args.rounds):
        for variant in variants:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
            cmd += ["--model", str(args.model)]
            env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            results[variant].append(got)
            print(f"round {round_} {variant}: {json.dumps(got)}", file=sys.stderr)
    name, peak = device_peak(args)

    def tok_s(variant: str) -> float:
        return statistics.fmean(r["tok_s"] for r in results[variant])

    def peak_mem(variant: str) -> float:
        return round(max(r["peak_mem_gib"] for r in results[variant]), 3)

    def mfu(variant: str, flops_per_param: int = 6) -> float:
        return round(flops_per_param * params * tok_s(variant) / (peak * 1e12), 4)

    summary: dict = {}
    if "packed" in results:
        summary |= {
            "tok_s": round(tok_s("packed"), 1),
            "mfu": mfu("packed"),
            "peak_mem_gib": peak_mem("packed"),
        }
    if "padded" in results:
        summary |= {
            "padding_fraction": round(
                statistics.fmean(r["padding_fraction"] for r in results["padded"]), 3
            ),
            "padded_tok_s": round(tok_s("padded"), 1),
            "padded_mfu": mfu("padded"),
            "padded_peak_mem_gib": peak_mem("padded"),
        }
    if "packed" in results and "padded" in results:
        summary["packed_vs_padded"] = round(tok_s("packed") / tok_s("padded"), 3)
    if "padded-fp32" in results:
        summary["fp32_tok_s"] = round(tok_s("padded-fp32"), 1)
        summary["fp32_mfu"] = mfu("padded-fp32")
        summary["fp32_peak_mem_gib"] = peak_mem("padded-fp32")
        if "padded" in results:
            summary["bf16_vs_fp32"] = round(tok_s("padded") / tok_s("padded-fp32"), 3)
    if "padded-lora" in results:
        summary["lora_r"] = args.lora_r
        summary["lora_tok_s"] = round(tok_s("padded-lora"), 1)
        summary["lora_mfu"] = mfu("padded-lora", 4)
        summary["lora_mfu_6n"] = mfu("padded-lora")
        summary["lora_peak_mem_gib"] = peak_mem("padded-lora")
        if "padded" in results:
            summary["lora_vs_full"] = round(tok_s("padded-lora") / tok_s("padded"), 3)
    if "packed-unchunked" in results and "packed" in results:
        unchunked = peak_mem("packed-unchunked")
        summary["unchunked_peak_mem_gib"] = unchunked
        summary["chunked_peak_vs_unchunked"] = round(summary["peak_mem_gib"] / unchunked, 3)
    summary |= {
        "device": name,
        "peak_tflops": round(peak, 3),
        "params": params,
        "shape": args.shape,
        "batch": f"{args.prompts_per_step}x{args.group_size}",
        "micro_batch_size": args.micro_batch_size,
        "torch_compile": args.torch_compile,
        "rounds": args.rounds,
    }
    print(json.dumps(summary))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()

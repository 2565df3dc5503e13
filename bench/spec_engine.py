"""Speculative decoding from history in the transformers engine alone, against plain decoding.

Epochs of the same prompts (N prompts x a group of G samples, temperature 1.0, fresh seeds each
epoch, the same seeds for both variants of an epoch): epoch 1 runs plain; from epoch 2 on each
epoch runs plain and speculative (alternated, `--rounds` times each, the best wall time of each
kept: other work on the machine only slows a run), each request drafted from the previous
epoch's responses to its prompt (RhymeRL's HistoSpec), and with `--siblings` also from its
group's responses that finished before it in this epoch (handed to the running requests as they
finish, as the coordinator would). Each variant keeps at most `--slots` requests running.

Measures, over the epochs from 2 on: `identical_frac` (share of responses whose tokens equal
plain decoding's: exact verification yields the same tokens, up to float noise landing a draw on
another token), `tokens_per_forward` (tokens per request per forward pass, speculative),
`speedup` (plain wall time / speculative), and the first epoch's response lengths. Prints one
line per epoch and, as its LAST line, one JSON object.

    .venv/bin/python bench/spec_engine.py                          # a tiny arithmetic model
    .venv/bin/python bench/spec_engine.py --task NAME --model DIR  # a task's pre-trained model

Without `--model` it builds a small model of `--task` in a temporary folder (init_model, tens of
seconds). The embedded arithmetic task answers in ~4 tokens: there is little to draft there;
the figures that matter come from a long-response task.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", default="arithmetic", help="task registry name")
    p.add_argument("--task-path", default=None, help="the task's file, where it reads one")
    p.add_argument("--model", default=None, help="model folder (default: build a tiny one)")
    p.add_argument("--init-steps", type=int, default=150, help="pre-training of a built model")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--siblings", action="store_true", help="draft from finished siblings too")
    p.add_argument("--rounds", type=int, default=3, help="timed runs of each variant (best)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_model(args: argparse.Namespace, folder: Path) -> Path:
    from services.trainer.init_model import InitModelSpec, init_model

    spec = InitModelSpec(
        task=args.task,
        task_path=args.task_path,
        hidden_size=64,
        layers=2,
        heads=2,
        pretrain_steps=args.init_steps,
        batch_size=64,
    )
    return init_model(folder / "model", spec)


def prompt_ids(args: argparse.Namespace, model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from services.tasks import load_task

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    examples = load_task(args.task, args.task_path).examples(args.seed, 0, args.prompts)
    return [list(tokenizer.encode(ex.prompt)) for ex in examples]


def epoch_jobs(args, prompts, epoch: int, stop: list[int]) -> list[Any]:
    from services.contracts.messages import Job
    from services.contracts.sampling import SamplingParams

    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    return [
        Job(
            run_id="bench",
            request_id=f"{epoch}:{p}:{s}",
            lease=0,
            grant="bench",
            step=epoch,
            prompt_ids=ids,
            remaining_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=(args.seed * 1_000_003 + epoch) * 1_000_003 + p * 1009 + s,
            stop_token_ids=stop,
        )
        for p, ids in enumerate(prompts)
        for s in range(args.group)
    ]


def prompt_of(request_id: str) -> int:
    return int(request_id.split(":")[1])


def generate(engine, jobs, history, siblings: bool) -> tuple[dict[str, list[int]], float]:
    """Run `jobs` to their end, at most `engine.capacity` at once; with `history` (prompt ->
    responses), each drafted from its prompt's, and its finished siblings' with `siblings`.
    Each response's tokens, and the wall time."""
    out: dict[str, list[int]] = {}
    done: dict[int, list[list[int]]] = {}
    waiting = list(jobs)
    started = time.perf_counter()
    while waiting or engine.active:
        while waiting and engine.active < engine.capacity:
            job = waiting.pop(0)
            if history is not None:
                p = prompt_of(job.request_id)
                job = job.replace(drafts=(history[p] + done.get(p, []))[-16:])
            engine.add(job)
        for ev in engine.decode():
            out.setdefault(ev.request_id, []).append(ev.token_id)
            if ev.finish_reason is not None and history is not None and siblings:
                p = prompt_of(ev.request_id)
                done.setdefault(p, []).append(out[ev.request_id])
                for rid in engine.seqs:
                    if prompt_of(rid) == p:
                        engine.set_drafts(rid, (history[p] + done[p])[-16:])
    return out, time.perf_counter() - started


def stop_token_ids(model: Path) -> list[int]:
    """The model's end-of-text ids (config.json), the stop tokens the coordinator gives jobs."""
    eos = json.loads((model / "config.json").read_text()).get("eos_token_id")
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    args = parse_args()
    import torch

    from services.rollout.engines.hf import HFEngine

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_model(args, Path(tmp))
        prompts = prompt_ids(args, model)
        stop = stop_token_ids(model)
        engine = HFEngine(slots=args.slots, draft_tokens=args.draft_tokens)
        engine.load_weights(model)
        generate(engine, epoch_jobs(args, prompts, 0, stop)[: args.slots], None, False)  # warm-up
        history: dict[int, list[list[int]]] = {}
        rows, lengths = [], []
        for epoch in range(1, args.epochs + 1):
            jobs = epoch_jobs(args, prompts, epoch, stop)
            plain, plain_s = generate(engine, jobs, None, False)
            row: dict[str, Any] = {"epoch": epoch}
            if epoch == 1:
                lengths = [len(t) for t in plain.values()]
            else:
                spec_s = float("inf")
                for r in range(args.rounds):  # alternated, the best of each: a busy machine
                    if r:
                        plain_s = min(plain_s, generate(engine, jobs, None, False)[1])
                    engine.spec_stats.__init__()
                    spec, took = generate(engine, jobs, history, args.siblings)
                    spec_s = min(spec_s, took)
                same = sum(spec[rid] == plain[rid] for rid in plain)
                stats = engine.spec_stats
                row |= {
                    "plain_s": round(plain_s, 3),
                    "spec_s": round(spec_s, 3),
                    "identical": same,
                    "responses": len(plain),
                    "tokens_per_forward": round(stats.tokens_per_forward, 3),
                    "tokens": stats.tokens,
                    "forwards": stats.forwards,
                    "drafted": stats.drafted,
                    "accepted": stats.accepted,
                    "speedup": round(plain_s / spec_s, 3),
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
            history = {}
            for rid in sorted(plain):
                history.setdefault(prompt_of(rid), []).append(plain[rid])
        later = rows[1:]
        forwards = sum(r["forwards"] for r in later)
        summary = {
            "task": args.task,
            "model": str(args.model or "built tiny"),
            "prompts": args.prompts,
            "group": args.group,
            "epochs": args.epochs,
            "draft_tokens": args.draft_tokens,
            "siblings": args.siblings,
            "temperature": args.temperature,
            "identical_frac": round(
                sum(r["identical"] for r in later) / max(1, sum(r["responses"] for r in later)), 4
            ),
            "tokens_per_forward": round(sum(r["tokens"] for r in later) / max(1, forwards), 3),
            "speedup": round(
                sum(r["plain_s"] for r in later) / max(1e-9, sum(r["spec_s"] for r in later)), 3
            ),
            "lengths_first_epoch_p50_p99": [percentile(lengths, 0.5), percentile(lengths, 0.99)],
            "per_epoch": rows,
        }
        print(json.dumps(summary))


if __name__ == "__main__":
    main()

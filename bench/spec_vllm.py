"""vLLM's own speculative decoding (`SPOTRL_VLLM_SPECULATION`) against plain vLLM decoding.

The same jobs (N prompts x a group of G samples of a task, the same seeds) run through the
vLLM engine built plain and built with each `--methods` proposer, at each `--temperatures`,
`--rounds` times each (the best wall time kept: other work on the machine only slows a run).
vLLM's proposers draft from the request's own prompt and response only (`Job.drafts` are not
used), and its rejection sampler keeps the distribution, not the tokens, so this measures:
`tok_s` (generated tokens / wall time), `speedup` (plain wall time / speculative),
`identical_frac` (share of responses equal to plain decoding's at the same seed) and
`self_identical_frac` (share equal between two rounds of the same variant: is it reproducible
at all). Prints one line per (method, temperature) and, as its LAST line, one JSON object.

    .venv/bin/python bench/spec_vllm.py --task long_addition --init-steps 300
    .venv/bin/python bench/spec_vllm.py --task long_addition --model DIR

Without `--model` it builds a small model of `--task` in a temporary folder (init_model: minutes
on a busy machine). Each variant starts its own vLLM (tens of seconds on CPU).
"""

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from long_tail import build_model, epoch_jobs, percentile, prompt_ids, stop_token_ids


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", default="long_addition", help="task registry name")
    p.add_argument("--task-path", default=None, help="the task's file, where it reads one")
    p.add_argument("--model", default=None, help="model folder (default: build a tiny one)")
    p.add_argument("--init-steps", type=int, default=300, help="pre-training of a built model")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=300)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--methods", default="ngram", help="comma-separated: ngram, suffix")
    p.add_argument("--temperatures", default="1.0,0.0", help="comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="timed runs of each variant (best)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


async def generate(engine, jobs) -> tuple[dict[str, list[int]], float]:
    """Run `jobs` to their end (vLLM queues what does not fit): each response's tokens, and
    the wall time."""
    out: dict[str, list[int]] = {rid: [] for rid in (j.request_id for j in jobs)}
    started = time.perf_counter()
    for j in jobs:
        engine.add(j)
    while engine.active:
        for ev in await engine.step():
            out[ev.request_id].append(ev.token_id)
    return out, time.perf_counter() - started


async def run_variant(args, model: Path, method: str, jobs_at: dict[float, list]) -> dict:
    """One vLLM engine built with `method`: each temperature's outputs (first round) and best
    wall time, and how many responses the second round reproduced."""
    from services.rollout.engines.vllm import VLLMEngine, VLLMOptions

    options = VLLMOptions(
        slots=args.slots,
        dtype="float32",
        kv_cache_gib=0.25,
        speculation=method,
        draft_tokens=args.draft_tokens,
        seed=args.seed,
    )
    engine = VLLMEngine(options)
    started = time.perf_counter()
    await engine.load(model)
    result: dict[str, Any] = {"start_s": round(time.perf_counter() - started, 1)}
    try:
        await generate(engine, jobs_at[max(jobs_at)][: args.slots])  # warm-up (kernels, JIT)
        for temp, jobs in jobs_at.items():
            runs = [await generate(engine, jobs) for _ in range(max(1, args.rounds))]
            first = runs[0][0]
            same = sum(all(r[0][rid] == first[rid] for r in runs) for rid in first)
            result[str(temp)] = {
                "out": first,
                "wall_s": min(s for _, s in runs),
                "self_identical": same,
            }
    finally:
        await engine.close()
    return result


def row(method: str, temp: float, plain: dict, spec: dict) -> dict:
    tokens = sum(len(t) for t in spec["out"].values())
    plain_tokens = sum(len(t) for t in plain["out"].values())
    n = len(plain["out"])
    return {
        "method": method,
        "temperature": temp,
        "responses": n,
        "tokens": tokens,
        "plain_tokens": plain_tokens,
        "tok_s": round(tokens / spec["wall_s"], 1),
        "plain_tok_s": round(plain_tokens / plain["wall_s"], 1),
        "speedup": round(plain["wall_s"] / spec["wall_s"], 3),
        "identical_frac": round(
            sum(spec["out"][rid] == plain["out"][rid] for rid in plain["out"]) / n, 4
        ),
        "self_identical_frac": round(spec["self_identical"] / n, 4),
        "plain_self_identical_frac": round(plain["self_identical"] / n, 4),
    }


def main() -> None:
    import repo_root  # noqa: F401  (the repository on sys.path)

    from services.rollout.engines.vllm import VLLMUnavailable

    args = parse_args()
    temps = [float(t) for t in args.temperatures.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_model(args, Path(tmp))
        prompts = prompt_ids(args, model)
        stop = stop_token_ids(model)
        jobs_at = {
            t: epoch_jobs(argparse.Namespace(**{**vars(args), "temperature": t}), prompts, 1, stop)
            for t in temps
        }
        variants, missing = {}, {}
        for m in ["off", *methods]:
            try:
                variants[m] = asyncio.run(run_variant(args, model, m, jobs_at))
            except VLLMUnavailable as exc:  # suffix without Arctic Inference: say so, go on
                missing[m] = str(exc)
    plain = variants["off"]
    rows = [
        row(m, t, plain[str(t)], variants[m][str(t)]) for m in variants if m != "off" for t in temps
    ]
    rows += [{"method": m, "unavailable": why} for m, why in missing.items()]
    for r in rows:
        print(json.dumps(r), flush=True)
    lengths = [len(t) for t in plain[str(temps[0])]["out"].values()]
    summary = {
        "task": args.task,
        "model": str(args.model or f"built tiny ({args.init_steps} steps)"),
        "prompts": args.prompts,
        "group": args.group,
        "draft_tokens": args.draft_tokens,
        "start_s": {m: v["start_s"] for m, v in variants.items()},
        "lengths_p50_p99": [percentile(lengths, 0.5), percentile(lengths, 0.99)],
        "rows": rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

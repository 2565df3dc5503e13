"""The hf engine's generation time when its torch work hops between threads (as
`asyncio.to_thread` does) against one compute thread (`services.infra.compute`), side by side.

Each variant runs in a fresh process with the same threads (2 by default, as `spotrl up` gives
a lone reserved worker): load the weights, then generate a step's batch (128 requests x 6
tokens) `--reps` times through the engine's async `step()`; `to_thread` is what the engine
did before. The variants alternate for `--rounds`. Prints each round's medians to stderr and,
as its LAST line, one JSON object: median ms per batch of each variant and their ratio.

    .venv/bin/python bench/compute_thread.py [--model DIR] [--threads 2] [--rounds 3]
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import repo_root  # noqa: F401  (the repository root on sys.path)

VARIANTS = ("to_thread", "compute")


async def one_variant(model: Path, variant: str, reps: int, batch: int, tokens: int) -> float:
    """Median seconds to generate `batch` x `tokens` through HFEngine.step in this process."""
    from services.contracts.messages import Job
    from services.contracts.sampling import SamplingParams
    from services.rollout.engines import hf

    if variant == "to_thread":  # the engine as it was: each call on a free pool thread
        hf.compute = asyncio.to_thread  # type: ignore[assignment]
    engine = hf.HFEngine(slots=batch)
    await engine.load(model)
    times = []
    for rep in range(reps):
        for i in range(batch):
            engine.add(
                Job(
                    run_id="bench",
                    request_id=f"{rep}:{i}",
                    lease=0,
                    grant="bench",
                    step=0,
                    prompt_ids=[5, 6, 7, 8, 9, 10],
                    remaining_tokens=tokens,
                    sampling=SamplingParams(),
                    seed=i,
                )
            )
        started = time.perf_counter()
        while engine.active:
            await engine.step()
            await asyncio.sleep(0)  # the worker's other tasks run between steps
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(".spotrl/models/arithmetic-base"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=6)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one child
    args = parser.parse_args()
    if args.variant:
        import torch

        torch.set_num_threads(args.threads)
        took = asyncio.run(
            one_variant(args.model, args.variant, args.reps, args.batch, args.tokens)
        )
        print(json.dumps({"s": took}))
        return
    if not (args.model / "config.json").is_file():
        raise SystemExit(
            f"no model at {args.model}: build one with `spotrl init-model {args.model}`"
        )
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--variant", variant, "--model", str(args.model)]
            cmd += ["--threads", str(args.threads), "--reps", str(args.reps)]
            cmd += ["--batch", str(args.batch), "--tokens", str(args.tokens)]
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            medians[variant].append(json.loads(done.stdout.strip().splitlines()[-1])["s"])
            print(
                f"round {round_} {variant}: {medians[variant][-1] * 1000:.1f} ms", file=sys.stderr
            )
    ms = {v: round(statistics.median(x) * 1000, 2) for v, x in medians.items()}
    summary = {f"{v}_ms": ms[v] for v in VARIANTS}
    summary |= {"ratio_to_thread_over_compute": round(ms["to_thread"] / ms["compute"], 3)}
    summary |= {"threads": args.threads, "batch": args.batch, "tokens": args.tokens}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

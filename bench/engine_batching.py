"""Tokens/s of the transformers engine alone, by batch size, on the embedded default's model.

Shows where batching stops paying (the plateau batch size the load balancer will use). Prints
one JSON object as its LAST line: {"batch": {B: tok_s}, "plateau_batch": B, ...}.

    .venv/bin/python bench/engine_batching.py [--model DIR] [--tokens 32] [--threads 1]
"""

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=".spotrl/models/arithmetic-base")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    args = parser.parse_args()

    import torch

    from services.contracts.messages import Job
    from services.contracts.sampling import SamplingParams
    from services.rollout.engines.hf import HFEngine

    torch.set_num_threads(args.threads)
    engine = HFEngine()
    engine.load_weights(Path(args.model))
    prompt = [5, 6, 7, 8, 9, 10]
    results = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        for i in range(batch):
            engine.add(
                Job(
                    run_id="bench",
                    request_id=str(i),
                    lease=0,
                    grant="bench",
                    step=0,
                    prompt_ids=prompt,
                    remaining_tokens=args.tokens,
                    sampling=SamplingParams(),
                    seed=i,
                )
            )
        started = time.perf_counter()
        tokens = 0
        while engine.active:
            tokens += len(engine.decode())
        results[batch] = round(tokens / (time.perf_counter() - started), 1)
        print(f"batch {batch:4d}: {results[batch]:9.1f} tok/s", flush=True)
    best = max(results.values())
    plateau = min(b for b, v in results.items() if v >= 0.9 * best)
    print(
        json.dumps(
            {
                "batch": results,
                "plateau_batch": plateau,
                "threads": args.threads,
                "new_tokens": args.tokens,
                "model": args.model,
            }
        )
    )


if __name__ == "__main__":
    main()

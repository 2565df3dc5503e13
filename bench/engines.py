"""The two rollout engines side by side, and what the protocol around them costs.

One model, one batch (the prompts of one RL step x the group size, every response exactly
`--tokens` long), on this machine:

1. each engine alone, in this process: `hf_tok_s` (transformers) and `vllm_tok_s` (vLLM);
2. the whole system: a local deployment (Redis, weight store, coordinator, trainer, one rollout
   worker with that engine and as many slots as the batch) runs `--steps` RL steps on the same
   prompts; its rate is the coordinator's rollout tokens/s per step (jobs queued to last delta,
   weight reload included), median over steps >= 1 (step 0 also starts the engine);
3. `protocol_overhead_ratio` = system tokens/s / engine-alone tokens/s for vLLM (the production
   engine); `protocol_overhead_ratio_hf` the same for transformers.

The trainer trains once per step on the whole batch (one micro-batch), after rollout, as it
would on its own hardware; here it shares the 2 cores only between rollouts.

Prints one JSON object as its LAST line.

    .venv/bin/python bench/engines.py [--hidden 256 --layers 4] [--prompts 16 --group-size 4]
"""

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def build_model(out: Path, hidden: int, layers: int) -> Path:
    import torch

    from services.trainer.init_model import InitModelSpec, init_model

    torch.set_num_threads(1)
    spec = InitModelSpec(
        hidden_size=hidden, layers=layers, heads=max(1, hidden // 64), pretrain_steps=20
    )
    return init_model(out, spec)


def step_prompts(model: Path, seed: int, step: int, count: int) -> list[list[int]]:
    """The prompts the coordinator queues for (seed, step): same task, same tokenizer."""
    from tokenizers import Tokenizer

    from services.tasks import load_task

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    examples = load_task("arithmetic").examples(seed, step, count)
    return [tokenizer.encode(e.prompt).ids for e in examples]


def jobs_for(prompts: list[list[int]], group_size: int, tokens: int) -> list:
    from services.contracts.messages import Job
    from services.contracts.sampling import SamplingParams

    return [
        Job(
            run_id="bench",
            request_id=f"{p}:{s}",
            lease=0,
            grant="bench",
            step=0,
            prompt_ids=prompt,
            remaining_tokens=tokens,
            sampling=SamplingParams(),
            seed=p * 1000 + s,
        )
        for p, prompt in enumerate(prompts)
        for s in range(group_size)
    ]


async def engine_alone(engine, model: Path, jobs: list, repeats: int) -> float:
    """Median tokens/s of `repeats` runs of the whole batch, after a warm-up run."""
    await engine.load(model)
    rates = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        for job in jobs:
            engine.add(job)
        tokens = 0
        while engine.active:
            tokens += len(await engine.step())
        if i:  # the first run warms up
            rates.append(tokens / (time.perf_counter() - started))
    await engine.close()
    return statistics.median(rates)


def system_rate(work_dir: Path, model: Path, engine: str, args) -> tuple[float, list[float]]:
    from services.cli.client import CoordinatorClient
    from services.cli.local_deployment import DeploymentConfig
    from services.cli.local_deployment import LocalDeployment as Deployment
    from services.contracts.runspec import FINAL_STATES

    batch = args.prompts * args.group_size
    spec = {
        "model": str(model),
        "task": "arithmetic",
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "group_size": args.group_size,
        "max_new_tokens": args.tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "micro_batch_size": batch,
        "seed": args.seed,
    }
    config = DeploymentConfig(
        work_dir, reserved=0, preemptible=1, worker_slots=batch, engine=engine
    )
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        run_id = client.submit(spec)
        while (run := client.run(run_id))["state"] not in FINAL_STATES:
            dep.check_alive()
            time.sleep(0.5)
        if run["state"] != "succeeded":
            raise RuntimeError(f"{engine} run ended {run['state']}")
        rows = client.metrics(run_id)
    rates = [row["tokens_per_s"] for row in rows if row["step"] >= 1]
    return statistics.median(rates), rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="model folder (default: build one)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per response")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and vLLM's engine processes

    import torch

    from services.rollout.engines.hf import HFEngine
    from services.rollout.engines.vllm import VLLMEngine, VLLMOptions

    torch.set_num_threads(1)  # as each rollout worker of the deployment
    batch = args.prompts * args.group_size
    with tempfile.TemporaryDirectory(prefix="spotrl-bench-engines-") as tmp:
        model = (
            Path(args.model)
            if args.model
            else build_model(Path(tmp) / "model", args.hidden, args.layers)
        )
        # The system's step 1 onwards; the engine-alone runs use step 1's prompts.
        jobs = jobs_for(
            step_prompts(model, args.seed, 1, args.prompts), args.group_size, args.tokens
        )
        hf = asyncio.run(engine_alone(HFEngine(slots=batch), model, jobs, args.repeats))
        print(f"hf alone:       {hf:9.1f} tok/s", flush=True)
        vllm = asyncio.run(
            engine_alone(VLLMEngine(VLLMOptions(slots=batch)), model, jobs, args.repeats)
        )
        print(f"vllm alone:     {vllm:9.1f} tok/s", flush=True)
        sys_vllm, rates_vllm = system_rate(Path(tmp) / "sys-vllm", model, "vllm", args)
        print(f"vllm in system: {sys_vllm:9.1f} tok/s (steps {rates_vllm})", flush=True)
        sys_hf, rates_hf = system_rate(Path(tmp) / "sys-hf", model, "hf", args)
        print(f"hf in system:   {sys_hf:9.1f} tok/s (steps {rates_hf})", flush=True)
    print(
        json.dumps(
            {
                "hf_tok_s": round(hf, 1),
                "vllm_tok_s": round(vllm, 1),
                "vllm_vs_hf": round(vllm / hf, 2),
                "system_vllm_tok_s": round(sys_vllm, 1),
                "system_hf_tok_s": round(sys_hf, 1),
                "protocol_overhead_ratio": round(sys_vllm / vllm, 3),
                "protocol_overhead_ratio_hf": round(sys_hf / hf, 3),
                "batch": batch,
                "tokens_per_response": args.tokens,
                "model": args.model or f"qwen2 hidden {args.hidden} x {args.layers} layers",
                "threads": 1,
            }
        )
    )


if __name__ == "__main__":
    main()

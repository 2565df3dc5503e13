"""The TRL side of bench/vs_trl.py: Hugging Face TRL's GRPOTrainer on a model folder and a JSONL
dataset of {"prompt", "answer"} rows, with the exact-match reward, in this process.

Run by vs_trl.py in a process of its own (TRL, accelerate and datasets stay out of the services):

    .venv/bin/python bench/trl_side.py MODEL DATA.jsonl OUT.json --steps 30 ...

Writes OUT.json: {"step_s": [...], "reward": [...], "config": {...}}: each optimizer step's wall
time (from one step's end to the next's: generation, reward, forward, backward, optimizer) and
its mean reward.
"""

import argparse
import itertools
import json
import os
import time
from pathlib import Path


def exact_match(completions: list[str], answer: list[str], **_) -> list[float]:
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--adam-beta2", type=float, default=0.99)
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--loss-type", default="grpo")
    parser.add_argument("--scale-rewards", default="group")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    batch = args.prompts_per_step * args.group_size
    if batch % args.micro_batch_size:
        raise SystemExit("prompts-per-step x group-size must be a multiple of micro-batch-size")
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl-out"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=batch // args.micro_batch_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        adam_beta1=0.9,
        adam_beta2=args.adam_beta2,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=args.epsilon,
        loss_type=args.loss_type,
        scale_rewards=args.scale_rewards,
        num_iterations=1,
        temperature=1.0,
        top_p=1.0,
        shuffle_dataset=False,  # the file's order, as spotrl's --no-shuffle
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    data = load_dataset("json", data_files=args.data, split="train")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    ends: list[float] = []
    rewards: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            ends.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    step_s = [b - a for a, b in itertools.pairwise(ends)]
    Path(args.out).write_text(
        json.dumps(
            {
                "step_s": step_s,
                "reward": rewards,
                "config": {"threads": args.threads, "omp": os.environ.get("OMP_NUM_THREADS")},
            }
        )
    )


if __name__ == "__main__":
    main()

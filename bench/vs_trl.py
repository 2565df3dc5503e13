"""spotrl against Hugging Face TRL's GRPOTrainer, side by side in one run: the same small model,
the same JSONL dataset in the same order, the same exact-match reward, batch (16 prompts x 8
responses), learning rate, clip, loss aggregation and advantage scaling, on this machine.

TRL (`bench/trl_side.py`, a process of its own, 2 torch threads) first, then spotrl as a user
runs it (`spotrl up`, 1 reserved worker, no preemptible one); `--rounds 2` alternates them twice
to even out the machine's drift. A step's time: TRL's from one optimizer step's end to the
next's; spotrl's `step_s` (from the announce of the version that generated the step to the
commit of the next one). The first `--warmup` steps of each are left out.

    make setup-bench   # trl 1.16 (the bench extra)
    .venv/bin/python bench/vs_trl.py [--steps 40] [--rounds 1]

Prints each side's figures to stderr and, as its LAST line, one JSON object: spotrl_step_s,
trl_step_s, step_time_ratio (spotrl / TRL, aim <= 1.0), spotrl_reward_last10,
trl_reward_last10 (aim: spotrl's within 0.03 of TRL's or better), the split of spotrl's step...
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import repo_root  # noqa: F401  (the repository root on sys.path)

from services.tasks import load_task

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
SPLIT = ("rollout_s", "seed_wait_s", "train_wait_s", "train_compute_s", "checkpoint_s", "publish_s")


def write_dataset(path: Path, rows: int, seed: int) -> None:
    """Sums, one JSON row each ({"prompt": "37+58=", "answer": "95"}), in a fixed order."""
    examples = load_task("arithmetic").examples(seed, 0, rows)
    path.write_text(
        "".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in examples)
    )


def build_model(folder: Path, pretrain_steps: int) -> None:
    if (folder / "config.json").is_file():
        return
    env = os.environ | {"OMP_NUM_THREADS": "2"}
    cmd = [str(ROOT / ".venv/bin/spotrl"), "init-model", str(folder)]
    subprocess.run([*cmd, "--pretrain-steps", str(pretrain_steps)], check=True, env=env)


def mean_after(values: list[float], warmup: int) -> float:
    kept = values[warmup:]
    return statistics.fmean(kept) if kept else float("nan")


def run_trl(args, model: Path, data: Path, work: Path) -> dict:
    out = work / f"trl-{time.monotonic_ns()}.json"
    cmd = [PYTHON, str(ROOT / "bench/trl_side.py"), str(model), str(data), str(out)]
    cmd += ["--steps", str(args.steps), "--learning-rate", str(args.learning_rate)]
    cmd += ["--adam-beta2", str(args.adam_beta2), "--loss-type", args.loss_type]
    cmd += ["--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size)]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed)]
    env = os.environ | {"OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    got = json.loads(out.read_text())
    return {"step_s": got["step_s"], "reward": got["reward"]}


def run_spotrl(args, model: Path, data: Path, work: Path) -> dict:
    cmd = [str(ROOT / ".venv/bin/spotrl"), "up", "--model", str(model), "--dataset", str(data)]
    cmd += ["--prompt-field", "prompt", "--answer-field", "answer", "--reward", "exact_match"]
    cmd += ["--no-shuffle", "--reserved", "1", "--preemptible", "0"]
    cmd += ["--steps", str(args.steps), "--learning-rate", str(args.learning_rate)]
    cmd += ["--adam-beta2", str(args.adam_beta2), "--loss-type", args.loss_type]
    cmd += ["--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size)]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed)]
    cmd += ["--micro-batch-size", "32", "--lr-scheduler-type", "constant"]
    done = subprocess.run(cmd, check=True, cwd=work, capture_output=True, text=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    if summary["state"] != "succeeded":
        raise SystemExit(f"spotrl run {summary['state']}: {summary.get('error')}")
    rows = json.loads((work / summary["metrics_file"]).read_text())
    rows = [row for row in rows if "step_s" in row and "reward_mean" in row]
    return {
        "step_s": [row["step_s"] for row in rows],
        "reward": [row["reward_mean"] for row in rows],
        "split": {k: [row.get(k, 0.0) for row in rows] for k in SPLIT},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--adam-beta2", type=float, default=0.99)
    parser.add_argument("--loss-type", default="grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pretrain-steps", type=int, default=1000)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    model, data = work / "model", work / "data.jsonl"
    build_model(model, args.pretrain_steps)
    write_dataset(data, args.steps * args.prompts_per_step, args.seed)

    trl_steps, trl_rewards, ours_steps, ours_rewards = [], [], [], []
    split: dict[str, list[float]] = {k: [] for k in SPLIT}
    for round_ in range(args.rounds):
        trl = run_trl(args, model, data, work)
        ours = run_spotrl(args, model, data, work)
        trl_steps.append(mean_after(trl["step_s"], args.warmup))
        ours_steps.append(mean_after(ours["step_s"], args.warmup))
        trl_rewards.append(statistics.fmean(trl["reward"][-10:]))
        ours_rewards.append(statistics.fmean(ours["reward"][-10:]))
        for k in SPLIT:
            split[k].append(mean_after(ours["split"][k], args.warmup))
        print(
            f"round {round_}: TRL {trl_steps[-1]:.3f} s a step, reward (last 10) "
            f"{trl_rewards[-1]:.3f}; spotrl {ours_steps[-1]:.3f} s, {ours_rewards[-1]:.3f}",
            file=sys.stderr,
        )
    spotrl_step, trl_step = statistics.fmean(ours_steps), statistics.fmean(trl_steps)
    summary = {
        "spotrl_step_s": round(spotrl_step, 4),
        "trl_step_s": round(trl_step, 4),
        "step_time_ratio": round(spotrl_step / trl_step, 3),
        "spotrl_reward_last10": round(statistics.fmean(ours_rewards), 4),
        "trl_reward_last10": round(statistics.fmean(trl_rewards), 4),
        "reward_gap": round(statistics.fmean(ours_rewards) - statistics.fmean(trl_rewards), 4),
        "spotrl_split_s": {k: round(statistics.fmean(v), 4) for k, v in split.items()},
        "steps": args.steps,
        "rounds": args.rounds,
        "batch": f"{args.prompts_per_step}x{args.group_size}",
        "max_new_tokens": args.max_new_tokens,
        "work_dir": str(work),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

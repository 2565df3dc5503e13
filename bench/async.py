"""Asynchronous RL on this machine: `spotrl up` runs of max_staleness k = 0, 1 and 2 side by side
(issue 21): end-to-end tokens per second, wall time and reward of each.

The tasks make long-tailed response lengths, as RL rollouts have (log-normal: median e^mu,
`--sigma`, capped at `--max-len`). `letters` (the default): "letters ahk:" asks for any string
of those three letters, so each sample of a prompt draws its own length, as reasoning
responses do, and a group is complete only when its longest sample is; the reward (1 or 0,
bench/async_reward.py) is whether every letter is allowed. `copy`: "copy qwerty:" asks for the
string itself (exact match), so a group's samples all have one length. The bench writes the
task as a JSONL dataset, pre-trains a small base model on it once (`spotrl init-model --task
dataset`, kept in the work dir), and then every run uses that model, the dataset and the same
seed and settings (by default 2 preemptible workers and no reserved one: with k >= 1 the
reserved pool trains and generates nothing, so the comparison holds the rollout pool fixed;
`--reserved` changes it). The k values alternate for `--rounds`. Throughput is the run's
response tokens over the trainer's step times summed (from the first version's announcement to
the last: the RL steps, not the start of the services); reward is the mean of the last 10
steps' mean rewards.

Prints each run to stderr and, as its LAST line, one JSON object: k1_vs_k0_tok_s,
k2_vs_k0_tok_s, reward_k0, reward_k1, reward_k2, tok_s_k0.., wall_s_k0.., response_len_k0..

    .venv/bin/python bench/async.py                    # 40 steps of 32 x 8, 2 rounds
"""

import argparse
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
from pathlib import Path

import repo_root  # noqa: F401  (the repository root on sys.path)

ROOT = Path(__file__).resolve().parent.parent
REWARDS = {"copy": "exact_match", "letters": "bench.async_reward:only_letters"}


def write_dataset(
    path: Path, task: str, rows: int, mu: float, sigma: float, cap: int, seed: int
) -> None:
    """`copy`: {"prompt": "copy qwerty:", "answer": "qwerty"}, the answer's length log-normal
    (every sample of a prompt has the same length). `letters`: {"prompt": "letters ahk:",
    "answer": "hakkh", "letters": "ahk"}, any string of those letters of a log-normal length
    (each sample of a prompt draws its own length, as RL responses do)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(rows):
        n = max(1, min(cap, int(rng.lognormvariate(mu, sigma))))
        if task == "copy":
            text = "".join(rng.choice(string.ascii_lowercase) for _ in range(n))
            row = {"prompt": f"copy {text}:", "answer": text}
        else:
            letters = "".join(sorted(rng.sample(string.ascii_lowercase, 3)))
            text = "".join(rng.choice(letters) for _ in range(n))
            row = {"prompt": f"letters {letters}:", "answer": text, "letters": letters}
        lines.append(json.dumps(row) + "\n")
    path.write_text("".join(lines))


def build_model(folder: Path, data: Path, pretrain_steps: int) -> None:
    if (folder / "config.json").is_file():
        return
    cmd = [sys.executable, "-m", "services.cli.main", "init-model", str(folder)]
    cmd += ["--task", "dataset", "--task-path", str(data)]
    cmd += ["--pretrain-steps", str(pretrain_steps)]
    env = os.environ | {"OMP_NUM_THREADS": "2"}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)


def run_up(args, k: int, work: Path) -> dict:
    """One `spotrl up` run of max_staleness k; its throughput, wall time and rewards."""
    cmd = [sys.executable, "-m", "services.cli.main", "up", "--max-staleness", str(k)]
    cmd += ["--reserved", str(args.reserved), "--preemptible", str(args.preemptible)]
    cmd += ["--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step)]
    cmd += ["--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--temperature", str(args.temperature), "--seed", str(args.seed)]
    cmd += [
        "--model",
        str(work / "model"),
        "--task",
        "dataset",
        "--dataset",
        str(work / "data.jsonl"),
    ]
    cmd += ["--prompt-field", "prompt", "--answer-field", "answer", "--reward", REWARDS[args.task]]
    env = os.environ | {"SPOTRL_HOME": str(work), "SPOTRL_REWARD_MODULES": "bench.async_reward"}
    if args.split_cores:  # the trainer on core 0, the rollout workers on core 1
        env["SPOTRL_CPUS"] = "0"
        cmd += ["--worker-env", "SPOTRL_CPUS=1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"spotrl up (k={k}) exited {done.returncode}:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    if summary["state"] != "succeeded":
        raise SystemExit(f"spotrl up (k={k}): {summary['state']}: {summary.get('error')}")
    rows = json.loads(Path(summary["metrics_file"]).read_text())
    trained = [r for r in rows if "step_s" in r and "response_tokens" in r]
    tokens = sum(r["response_tokens"] for r in trained)
    seconds = sum(r["step_s"] for r in trained)
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    return {
        "tok_s": tokens / seconds,
        "wall_s": seconds,
        "reward_last10": statistics.fmean(rewards[-10:]),
        "response_len_mean": tokens / (len(trained) * args.prompts_per_step * args.group_size),
        "lost": summary["lost"],
        "duplicated": summary["duplicated"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reserved", type=int, default=0)
    parser.add_argument("--preemptible", type=int, default=2)
    parser.add_argument("--task", choices=sorted(REWARDS), default="letters")
    parser.add_argument("--mu", type=float, default=2.0, help="log-normal mu of answer lengths")
    parser.add_argument(
        "--sigma", type=float, default=1.0, help="log-normal sigma of answer lengths"
    )
    parser.add_argument("--max-len", type=int, default=60, help="answer lengths are capped here")
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--split-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trainer and workers on cores of their own (SPOTRL_CPUS), as on their own hardware",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ks", default="0,1,2")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-async-"))
    work.mkdir(parents=True, exist_ok=True)
    write_dataset(
        work / "data.jsonl", args.task, 20000, args.mu, args.sigma, args.max_len, args.seed
    )
    build_model(work / "model", work / "data.jsonl", args.pretrain_steps)
    ks = [int(k) for k in args.ks.split(",")]
    results: dict[int, list[dict]] = {k: [] for k in ks}
    for round_ in range(args.rounds):
        for k in ks:
            got = run_up(args, k, work)
            results[k].append(got)
            print(f"round {round_} k={k}: {json.dumps(got)}", file=sys.stderr, flush=True)

    def mean(k: int, field: str) -> float:
        return statistics.fmean(r[field] for r in results[k])

    summary: dict = {}
    for k in ks:
        if k and 0 in results:
            summary[f"k{k}_vs_k0_tok_s"] = round(mean(k, "tok_s") / mean(0, "tok_s"), 3)
    for k in ks:
        summary[f"reward_k{k}"] = round(mean(k, "reward_last10"), 4)
    for k in ks:
        summary[f"tok_s_k{k}"] = round(mean(k, "tok_s"), 1)
        summary[f"wall_s_k{k}"] = round(mean(k, "wall_s"), 2)
        summary[f"response_len_k{k}"] = round(mean(k, "response_len_mean"), 2)
    summary["lost"] = sum(r["lost"] for rs in results.values() for r in rs)
    summary["duplicated"] = sum(r["duplicated"] for rs in results.values() for r in rs)
    summary |= {
        "task": args.task,
        "steps": args.steps,
        "batch": f"{args.prompts_per_step}x{args.group_size}",
        "max_new_tokens": args.max_new_tokens,
        "answer_len_mu": args.mu,
        "workers": f"{args.reserved} reserved + {args.preemptible} preemptible",
        "split_cores": args.split_cores,
        "rounds": args.rounds,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Asynchronous RL on this machine: `spotrl up` runs of max_staleness k = 0, 1 and 2 side by side
(issue 21): end-to-end tokens per second, wall time and reward of each.

Every run is the embedded default's services and built-in task with the same seed and settings
(by default 2 preemptible workers and no reserved one: with k >= 1 the reserved pool trains and
generates nothing, so the comparison holds the rollout pool fixed; `--reserved` changes it), a
few hundred responses a step whose lengths are long-tailed (temperature 1.0 on the small
pre-trained model: most answers stop early, some run to `--max-new-tokens`). The k values
alternate for `--rounds`. Throughput is the run's response tokens over the trainer's step
times summed (from the first version's announcement to the last: the RL steps, not the start
of the services); reward is the mean of the last 10 steps' mean rewards.

Prints each run to stderr and, as its LAST line, one JSON object: k1_vs_k0_tok_s,
k2_vs_k0_tok_s, reward_k0, reward_k1, reward_k2, tok_s_k0.., wall_s_k0.., max_staleness_k..

    .venv/bin/python bench/async.py                    # 40 steps of 32 x 8, 2 rounds
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import repo_root  # noqa: F401  (the repository root on sys.path)

ROOT = Path(__file__).resolve().parent.parent


def run_up(args, k: int, work: Path) -> dict:
    """One `spotrl up` run of max_staleness k; its throughput, wall time and rewards."""
    cmd = [sys.executable, "-m", "services.cli.main", "up", "--max-staleness", str(k)]
    cmd += ["--reserved", str(args.reserved), "--preemptible", str(args.preemptible)]
    cmd += ["--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step)]
    cmd += ["--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--temperature", "1.0", "--seed", str(args.seed), "--task", args.task]
    env = os.environ | {"SPOTRL_HOME": str(work)}
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
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--reserved", type=int, default=0)
    parser.add_argument("--preemptible", type=int, default=2)
    parser.add_argument("--task", default="arithmetic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ks", default="0,1,2")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-async-"))
    work.mkdir(parents=True, exist_ok=True)
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
        "steps": args.steps,
        "batch": f"{args.prompts_per_step}x{args.group_size}",
        "max_new_tokens": args.max_new_tokens,
        "workers": f"{args.reserved} reserved + {args.preemptible} preemptible",
        "rounds": args.rounds,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

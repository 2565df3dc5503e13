"""Multi-turn episodes on the embedded default (issue 40): does the built-in multi-turn task
learn, and what does token-level migration save when a worker dies in the middle of episodes?

1. Learning: one run of the embedded model with the `retry_arithmetic` environment (a wrong sum
   is told " no" and asked again, up to `--max-turns`; a right answer at turn t scores
   1 / 2**(t-1)) on a reserved and a preemptible worker, as `spotrl up` runs it: the mean
   reward and turns per episode of the first and the last 10 steps, and the tokens/s.
2. Preemption, side by side on one deployment of three preemptible workers (each decode step
   slowed by `--step-delay-ms`, standing in for a larger model): the same two-step run with a
   worker SIGKILLed once `--kill-at` of step 0's episodes are over, with token-level migration
   and with whole-episode restart (migration off). Tokens generated again after the kill
   (`regenerated_tokens` of step 0) and the step's rollout time, each against an undisturbed
   run.

Prints one JSON object as its LAST line: reward_first10, reward_last10, turns_first10,
turns_last10, tokens_per_s, regen_migration, regen_restart, regen_restart_vs_migration,
delay_s_migration, delay_s_restart, lost, duplicated.

    .venv/bin/python bench/multi_turn.py [--steps 40] [--kill-at 0.5]
"""

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import redis

if not __package__:  # run as a script: bench/ is on sys.path, the repo root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.preemption import holders, replace_workers
from bench.runs import wait_final
from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.cli.local_deployment import DeploymentConfig
from services.cli.local_deployment import LocalDeployment as Deployment
from services.cli.up import ensure_model
from services.contracts import keys
from services.contracts.runspec import RunSpec


def episode_spec(model: Path, steps: int, max_turns: int, **over) -> RunSpec:
    """The embedded default's run with the retry_arithmetic environment: a budget that holds
    `max_turns` answers and the sum asked again between them."""
    fields = {
        "model": str(model.resolve()),
        "steps": steps,
        "prompts_per_step": 32,
        "group_size": 8,
        "max_new_tokens": 32,
        "environment": "retry_arithmetic",
        "max_turns": max_turns,
        "stall_timeout_s": 300.0,
    }
    return RunSpec.model_validate(fields | over)


def mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def learning(model: Path, work: Path, steps: int, max_turns: int) -> dict:
    config = DeploymentConfig(work / "learn", reserved=1, preemptible=1)
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        spec = episode_spec(model, steps, max_turns)
        run_id = client.submit(json.loads(spec.model_dump_json()))
        run = wait_final(client, run_id, 3600)
        rows = client.metrics(run_id)
        audit = audit_run(dep.redis_url, run_id, spec)
    first, last = rows[:10], rows[-10:]
    return {
        "state": run["state"],
        "reward_first10": mean([r["reward_mean"] for r in first]),
        "reward_last10": mean([r["reward_mean"] for r in last]),
        "turns_first10": mean([r["turns_mean"] for r in first]),
        "turns_last10": mean([r["turns_mean"] for r in last]),
        "turns_mean": mean([r["turns_mean"] for r in rows]),
        "tokens_per_s": mean([r["tokens_per_s"] for r in rows]),
        "lost": audit["lost"],
        "duplicated": audit["duplicated"],
    }


def episodes_over(r: redis.Redis, run_id: str) -> int:
    """Episodes of step 0 over so far (every shard's table in Redis: finished requests)."""
    states = r.hvals(keys.step_requests(run_id, 0))
    return sum(1 for s in states if s.split(b"|")[1])


def one_run(dep, client, r, spec: RunSpec, kill_at: float | None) -> dict:
    run_id = client.submit(json.loads(spec.model_dump_json()))
    killed = []
    if kill_at is not None:
        goal = kill_at * spec.training.prompts_per_step * spec.training.group_size
        while episodes_over(r, run_id) < goal:
            time.sleep(0.01)
        busy = holders(r, keys.jobs_stream(run_id, 0))
        if busy:
            dep.procs[busy[0]].popen.send_signal(signal.SIGKILL)
            killed.append(busy[0])
    run = wait_final(client, run_id, 600)
    row = client.metrics(run_id)[0]
    audit = audit_run(dep.redis_url, run_id, spec)
    replace_workers(dep, killed)
    return {
        "killed": len(killed),
        "state": run["state"],
        "rollout_s": row["rollout_s"],
        "regenerated_tokens": row["regenerated_tokens"],
        **audit,
    }


def preemption(model: Path, work: Path, args: argparse.Namespace) -> dict:
    env = {
        "SPOTRL_STEP_DELAY_MS": str(args.step_delay_ms),
        "SPOTRL_HEARTBEAT_TTL_S": "1.0",
        "SPOTRL_HEARTBEAT_S": "0.25",
    }
    config = DeploymentConfig(
        work / "kill", reserved=0, preemptible=3, worker_slots=32, flush_tokens=4, extra_env=env
    )
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        r = redis.Redis.from_url(dep.redis_url)
        base = episode_spec(model, 2, args.max_turns, temperature=1.5, prompts_per_step=16)
        restart = base.model_copy(
            update={"rollout": base.rollout.model_copy(update={"migration": False})}
        )
        one_run(dep, client, r, base, None)  # warm-up: loads, imports
        calm = one_run(dep, client, r, base, None)
        migration = one_run(dep, client, r, base, args.kill_at)
        one_run(dep, client, r, base, None)  # warm the new worker up
        whole = one_run(dep, client, r, restart, args.kill_at)
    return {"calm": calm, "migration": migration, "restart": whole}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=".spotrl/models/arithmetic-base")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--kill-at", type=float, default=0.5, help="share of episodes over")
    parser.add_argument("--step-delay-ms", type=float, default=30.0)
    args = parser.parse_args()
    model = ensure_model(Path(args.model), "arithmetic", None, 1000)
    work = Path(tempfile.mkdtemp(prefix="spotrl-bench-multi-turn-"))
    learned = learning(model, work, args.steps, args.max_turns)
    kills = preemption(model, work, args)
    print(f"learning: {learned}")
    for name, res in kills.items():
        print(f"{name:10s} {res}")
    mig, whole, calm = kills["migration"], kills["restart"], kills["calm"]
    print(
        json.dumps(
            {
                "reward_first10": round(learned["reward_first10"], 4),
                "reward_last10": round(learned["reward_last10"], 4),
                "turns_first10": round(learned["turns_first10"], 3),
                "turns_last10": round(learned["turns_last10"], 3),
                "turns_mean": round(learned["turns_mean"], 3),
                "tokens_per_s": round(learned["tokens_per_s"], 1),
                "regen_migration": mig["regenerated_tokens"],
                "regen_restart": whole["regenerated_tokens"],
                "regen_restart_vs_migration": round(
                    whole["regenerated_tokens"] / max(1, mig["regenerated_tokens"]), 2
                ),
                "delay_s_migration": round(mig["rollout_s"] - calm["rollout_s"], 3),
                "delay_s_restart": round(whole["rollout_s"] - calm["rollout_s"], 3),
                "lost": learned["lost"] + mig["lost"] + whole["lost"],
                "duplicated": learned["duplicated"] + mig["duplicated"] + whole["duplicated"],
                "steps": args.steps,
                "kill_at": args.kill_at,
                "step_delay_ms": args.step_delay_ms,
            }
        )
    )


if __name__ == "__main__":
    main()

"""Preemption overhead with token-level migration vs recompute-from-scratch.

Runs the same run on one local deployment (3 preemptible workers): undisturbed (twice, for the
baseline), then twice with the same kill schedule (one worker gets SIGTERM, the notice; one gets
SIGKILL, found by its missed heartbeat) once `--kill-at` of step 0's tokens are collected, once
with migration on and once off (a preempted response restarts from zero). Workers sleep
`--step-delay-ms` after each decode step to stand in for a larger model.

Prints one JSON object as its LAST line: lost, duplicated, regenerated_tokens_migration,
regenerated_tokens_recompute, overhead_s_*, overhead_reduction (1 - overhead with migration /
overhead with recompute; overhead = step-0 rollout time minus the undisturbed one).

    .venv/bin/python bench/preemption.py [--kill-at 0.8] [--kills sigterm,sigkill]
"""

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

if not __package__:  # run as a script: bench/ is on sys.path, the repo root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.runs import wait_final
from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.cli.local_deployment import DeploymentConfig
from services.cli.local_deployment import LocalDeployment as Deployment
from services.cli.up import ensure_model
from services.contracts import keys
from services.contracts.runspec import RunSpec


def holders(r: redis.Redis, stream: str) -> list[str]:
    try:
        consumers = r.xinfo_consumers(stream, keys.WORKERS_GROUP)
    except redis.ResponseError:
        return []
    names = [c["name"] for c in consumers if c["pending"] > 0]
    return [n.decode() if isinstance(n, bytes) else n for n in names]


def collected_tokens(url: str) -> float:
    """The coordinator's counter of response tokens collected (all runs)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("spotrl_coordinator_tokens_total "):
            return float(line.split()[1])
    return 0.0


def replace_workers(dep, names: list[str]) -> None:
    """A new preemptible worker in the place of each of these (stopped or killed) for the
    next run."""
    for name in names:
        dep.procs.pop(name).popen.wait(30)
        dep.add_worker("preemptible")


def bench_spec(model: Path, steps: int, max_new_tokens: int) -> RunSpec:
    """The run the preemption and recovery benchmarks repeat: 8 prompts of 4 samples, each of
    exactly `max_new_tokens` tokens (EOS ignored), so that every step does the same work."""
    return RunSpec(
        model=str(model.resolve()),
        steps=steps,
        prompts_per_step=8,
        group_size=4,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        temperature=1.0,
    )


def one_run(dep, client, r, spec: RunSpec, kill_at: float | None, kills: list[str]) -> dict:
    start_tokens = collected_tokens(dep.coordinator_url)
    run_id = client.submit(json.loads(spec.model_dump_json()))
    stream = keys.jobs_stream(run_id, 0)
    victims: list[str] = []
    if kill_at is not None:
        goal = (
            start_tokens
            + kill_at
            * spec.training.prompts_per_step
            * spec.training.group_size
            * spec.sampling.max_new_tokens
        )
        while collected_tokens(dep.coordinator_url) < goal:
            time.sleep(0.01)
        busy = holders(r, stream)
        for kind, name in zip(kills, busy, strict=False):
            proc = dep.procs[name]
            proc.popen.send_signal(signal.SIGTERM if kind == "sigterm" else signal.SIGKILL)
            victims.append(name)
    run = wait_final(client, run_id, 600)
    row = client.metrics(run_id)[0]
    audit = audit_run(dep.redis_url, run_id, spec)
    replace_workers(dep, victims)
    return {
        "state": run["state"],
        "rollout_s": row["rollout_s"],
        "regenerated_tokens": row["regenerated_tokens"],
        "migrations": row["migrations"],
        "killed": len(victims),
        **audit,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=".spotrl/models/arithmetic-base")
    parser.add_argument(
        "--kill-at",
        type=float,
        default=0.8,
        help="kill once this share of step 0's tokens is collected",
    )
    parser.add_argument("--kills", default="sigterm,sigkill")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--step-delay-ms", type=float, default=20.0)
    parser.add_argument("--heartbeat-ttl-s", type=float, default=1.0)
    args = parser.parse_args()

    model = ensure_model(Path(args.model), "arithmetic", None, 1000)
    env = {
        "SPOTRL_STEP_DELAY_MS": str(args.step_delay_ms),
        "SPOTRL_HEARTBEAT_TTL_S": str(args.heartbeat_ttl_s),
        "SPOTRL_HEARTBEAT_S": str(args.heartbeat_ttl_s / 4),
        "SPOTRL_PREEMPT_GRACE_S": "10",
    }
    work = Path(tempfile.mkdtemp(prefix="spotrl-bench-preemption-"))
    with Deployment(
        DeploymentConfig(
            work, reserved=0, preemptible=3, worker_slots=11, flush_tokens=4, extra_env=env
        )
    ) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        r = redis.Redis.from_url(dep.redis_url)
        base = bench_spec(model, 2, args.max_new_tokens)
        kills = args.kills.split(",")
        one_run(dep, client, r, base, None, [])  # warm-up: first loads, imports
        calm_runs = [one_run(dep, client, r, base, None, []) for _ in range(2)]
        calm = calm_runs[0] | {"rollout_s": sum(c["rollout_s"] for c in calm_runs) / 2}
        migration = one_run(dep, client, r, base, args.kill_at, kills)
        one_run(dep, client, r, base, None, [])  # warm the replacement workers up
        no_migration = base.rollout.model_copy(update={"migration": False})
        recompute = one_run(
            dep, client, r, base.model_copy(update={"rollout": no_migration}), args.kill_at, kills
        )
    over_mig = migration["rollout_s"] - calm["rollout_s"]
    over_rec = recompute["rollout_s"] - calm["rollout_s"]
    for name, res in (("undisturbed", calm), ("migration", migration), ("recompute", recompute)):
        print(
            f"{name:12s} step-0 rollout {res['rollout_s']:.2f}s  killed {res['killed']}  "
            f"regenerated {res['regenerated_tokens']}  migrations {res['migrations']}  "
            f"lost {res['lost']}  duplicated {res['duplicated']}"
        )
    print(
        json.dumps(
            {
                "lost": migration["lost"] + recompute["lost"],
                "duplicated": migration["duplicated"] + recompute["duplicated"],
                "regenerated_tokens_migration": migration["regenerated_tokens"],
                "regenerated_tokens_recompute": recompute["regenerated_tokens"],
                "baseline_rollout_s": round(calm["rollout_s"], 3),
                "overhead_s_migration": round(over_mig, 3),
                "overhead_s_recompute": round(over_rec, 3),
                "overhead_reduction": round(1 - over_mig / over_rec, 3) if over_rec > 0 else None,
                "kill_at": args.kill_at,
                "kills": kills,
                "step_delay_ms": args.step_delay_ms,
                "max_new_tokens": args.max_new_tokens,
                "heartbeat_ttl_s": args.heartbeat_ttl_s,
            }
        )
    )


if __name__ == "__main__":
    main()

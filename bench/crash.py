"""Crash safety under fire: one multi-step run of the embedded default while every service is
killed and restarted in turn, each time in the middle of a step (some, not all, of the step's
groups already handed to the trainer):

    coordinator (SIGKILL) -> trainer (SIGKILL) -> weight store (SIGKILL) -> Redis (restart with
    its append-only file) -> a preemptible worker (SIGKILL; a new one joins) -> coordinator ...

Then audits what reached the trainer: every (step, prompt) group once, each with n responses.
Prints progress to stderr and, as its LAST line, one JSON object with lost, duplicated,
restarts (by service), steps_trained, wall_s.

    .venv/bin/python bench/crash.py [--steps 15] [--prompts-per-step 16] [--no-crash]
    .venv/bin/python bench/crash.py --task long_addition --max-new-tokens 420 --step-delay-ms 0

Jobs carry drafts (`rollout.drafts`, history by default): the audit then also says that drafts
made across every kill no token lost or doubled.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import redis
import repo_root  # noqa: F401  (the repository root on sys.path: tests.harness)

from bench.runs import wait_final
from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.cli.up import ensure_model
from services.contracts import keys
from services.contracts.runspec import FINAL_STATES, RunSpec
from tests.harness.deploy import Deployment, DeploymentConfig

ORDER = ("coordinator", "trainer", "weightstore", "redis", "worker")


def mid_step(r: redis.Redis, run_id: str, prompts: int, after: int, timeout_s: float) -> int:
    """A step past `after` once some, not all, of its groups went to the trainer; -1 if the run
    ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            raw = r.get(keys.run_version(run_id))
            state = r.hget(keys.run(run_id), "state")
            if state is not None and state.decode() in FINAL_STATES:
                return -1
            if raw is not None and int(raw) > after:
                published = r.scard(keys.step_published(run_id, int(raw)))
                if 0 < published < prompts:
                    return int(raw)
        except redis.ConnectionError:
            pass  # Redis is the one restarting
        time.sleep(0.01)
    raise TimeoutError("never caught the run mid-step")


def crash(dep: Deployment, target: str) -> None:
    if target == "redis":
        dep.restart_redis()
    elif target == "worker":
        victim = next(p for n, p in dep.procs.items() if n.startswith("rollout-pre") and p.alive())
        victim.kill()
        dep.add_worker("preemptible", wait=False)
    else:
        dep.restart(target, kill=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--task", default="arithmetic", help="task registry name")
    parser.add_argument("--model", default=None, help="default: .spotrl/models/TASK-base")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the spec's")
    parser.add_argument(
        "--drafts", default="history", choices=("history", "off"), help="rollout.drafts"
    )
    parser.add_argument("--step-delay-ms", type=float, default=40.0)
    parser.add_argument(
        "--no-crash", action="store_true", help="the same run undisturbed, for the baseline"
    )
    args = parser.parse_args()
    model = ensure_model(
        Path(args.model or f".spotrl/models/{args.task}-base"), args.task, None, None
    )
    given = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    spec = RunSpec(
        model=str(model.resolve()),
        task=args.task,
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        drafts=args.drafts,
        **given,
    )
    restarts = dict.fromkeys(ORDER, 0)
    with tempfile.TemporaryDirectory(prefix="spotrl-crash-") as work:
        config = DeploymentConfig(
            Path(work),
            reserved=1,
            preemptible=2,
            redis_appendonly=True,
            extra_env={"SPOTRL_STEP_DELAY_MS": str(args.step_delay_ms)},
        )
        with Deployment(config) as dep, CoordinatorClient(dep.coordinator_url) as client:
            started = time.monotonic()
            run_id = client.submit(spec.model_dump(mode="json"))
            r = redis.Redis.from_url(dep.redis_url)
            step, turn = -1, 0
            while True:
                if args.no_crash:
                    wait_final(client, run_id, 1800)
                    break
                step = mid_step(r, run_id, spec.training.prompts_per_step, step, 600)
                if step < 0:
                    break
                target = ORDER[turn % len(ORDER)]
                print(f"step {step}: {target} down", file=sys.stderr, flush=True)
                crash(dep, target)
                r.connection_pool.disconnect()
                restarts[target] += 1
                turn += 1
            wait_final(client, run_id, 1800)  # the API's answer may trail Redis by a refresh
            run = client.run(run_id)
            rows = client.metrics(run_id)
            wall_s = time.monotonic() - started
            trained = int(r.hget(keys.trainer_state(run_id), "steps_trained") or 0)
            r.close()
            audit = audit_run(dep.redis_url, run_id, spec)
    print(
        json.dumps(
            {
                "state": run["state"],
                "task": args.task,
                "drafts": spec.rollout.drafts,
                "steps": spec.training.steps,
                "steps_trained": trained,
                "lost": audit["lost"],
                "duplicated": audit["duplicated"],
                "expected_responses": audit["expected_responses"],
                "restarts": restarts,
                "restarts_total": sum(restarts.values()),
                # tokens checked as drafts and kept (the engine drafts only where it pays)
                "drafted_tokens": sum(row.get("drafted_tokens") or 0 for row in rows),
                "accepted_tokens": sum(row.get("accepted_tokens") or 0 for row in rows),
                "wall_s": round(wall_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()

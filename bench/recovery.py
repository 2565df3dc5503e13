"""Recovery time from a lost rollout worker, with and without notice, side by side.

One run on one local deployment (3 preemptible workers), its steps all alike (8 prompts of 4
samples of exactly `--max-new-tokens` tokens). After `--warmup` steps, each step that starts with
all three workers serving the run takes the next part of the schedule, `--rounds` times over:

    none (the baseline) -> kill (SIGKILL: the coordinator finds the death by the missed
    heartbeat) -> notice (SIGTERM: the worker releases its requests and exits within its grace)

A loss hits the worker holding the most jobs once `--kill-at` of the step's tokens are collected.
The worker lost is replaced as the next step starts; that step, and any other that starts short
of three workers, only settles. The steps left after the schedule are baselines too.

For each loss, `services.cli.recovery` measures the time from the signal until every request the
worker held has a token stored under its new lease (generated elsewhere), and until each was
queued again (`migrated`); the step's delay is its rollout time minus the median baseline one.
Without notice, recovery cannot be shorter than the heartbeat's TTL less its period (the
worker's last heartbeat key outlives it by that much) plus the coordinator's check period
(0.25 s): a setting, not a cost of migration. With notice, it is the worker's flush and the
coordinator's next read, then a survivor's first flush. Workers sleep `--step-delay-ms` after
each decode step to stand in for a larger model.

Prints one line per step and, as its LAST line, one JSON object: recovery_kill_s and
recovery_notice_s (median, p90, n), migrated_*_s, step_delay_*_s, baseline_step_s (a baseline
step's rollout time), lost and duplicated (the run audited), the settings.

    .venv/bin/python bench/recovery.py [--rounds 3] [--heartbeat-ttl-s 5] [--kill-at 0.5]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

import redis

if not __package__:  # run as a script: bench/ is on sys.path, the repo root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.preemption import bench_spec, collected_tokens
from bench.runs import wait_final
from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.cli.recovery import RecoveryWatch, busiest_worker, distribution, held_requests
from services.cli.up import ensure_model
from services.contracts import keys
from services.contracts.messages import Heartbeat
from services.contracts.runspec import FINAL_STATES
from services.infra.settings import settings_env
from services.rollout.settings import RolloutSettings
from tests.harness.deploy import Deployment, DeploymentConfig

CAUSES = ("none", "kill", "notice")
WORKERS = 3
RECOVERY_TIMEOUT_S = 120.0


def step_started(r: redis.Redis, run_id: str, step: int, timeout_s: float = 600) -> str | None:
    """Until the step's jobs are queued: "now" while it goes on, "past" if it is over already
    (its copy gone), None if the run ended first."""
    deadline = time.monotonic() + timeout_s
    while True:
        with r.pipeline(transaction=True) as pipe:
            pipe.exists(keys.step_meta(run_id, step))
            pipe.get(keys.run_version(run_id))
            pipe.hget(keys.run(run_id), "state")
            queued, version, state = pipe.execute()
        if queued:
            return "now"
        if version is not None and int(version) > step:
            return "past"
        if state is not None and state.decode() in FINAL_STATES:
            return None
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} never started")
        time.sleep(0.01)


def serving(dep: Deployment, r: redis.Redis, run_id: str) -> int:
    """Workers alive that have loaded weights of the run (a replacement registers, and counts
    in the coordinator's pool, many seconds before its first weights are loaded)."""
    count = 0
    for proc in dep.workers():
        raw = cast(bytes | None, r.get(keys.worker_heartbeat(proc.name)))
        beat = Heartbeat.decode(raw) if raw is not None else None
        ours = beat.serving(run_id) if beat is not None else None
        if proc.alive() and ours is not None and ours.version is not None:
            count += 1
    return count


def lose_worker(dep: Deployment, r: redis.Redis, run_id: str, step: int, cause: str) -> dict:
    """SIGKILL or SIGTERM the worker holding the most jobs of `step`, and follow its requests
    (read after a SIGKILL, which freezes them; before a notice, which releases them)."""
    victim = busiest_worker(r, run_id, step)
    if victim is None:
        raise RuntimeError(f"no worker holds a job of step {step}")
    proc = dep.procs[victim]
    at = time.time()
    if cause == "kill":
        proc.kill()
        held = held_requests(r, run_id, victim, [step])
    else:  # what it holds as it gets the notice: before it, and what it read since
        held = held_requests(r, run_id, victim, [step])
        at = time.time()
        proc.preempt()
        held |= held_requests(r, run_id, victim, [step])
    watch = RecoveryWatch(r, run_id, victim, cause, held, at)
    return watch.wait(RECOVERY_TIMEOUT_S).summary()


def drive(dep: Deployment, r: redis.Redis, run_id: str, args, step_tokens: int) -> dict:
    """Act on each step of the run as it starts, until the schedule is done and the step after
    its last one has started (so that one is complete); what each step was."""
    schedule = [cause for _ in range(args.rounds) for cause in CAUSES]
    plan: dict[int, dict] = {}
    lost: str | None = None
    step = 0
    while schedule or lost:
        started = step_started(r, run_id, step)
        if started is None:
            break
        start_tokens = collected_tokens(dep.coordinator_url)
        if lost is not None:  # the worker lost in the step before: replaced now, if need be
            dep.procs[lost].popen.wait(60)
            if schedule:  # it joins when it can: steps start short of it until then
                dep.replace_worker(lost)
            lost, plan[step] = None, {"cause": "settle"}
        elif started == "past" or step < args.warmup or serving(dep, r, run_id) < WORKERS:
            plan[step] = {"cause": "settle"}
        else:
            cause = schedule.pop(0)
            plan[step] = {"cause": cause}
            if cause != "none":
                goal = start_tokens + args.kill_at * step_tokens
                while collected_tokens(dep.coordinator_url) < goal:
                    time.sleep(0.01)
                plan[step]["recovery"] = lose_worker(dep, r, run_id, step, cause)
                lost = plan[step]["recovery"]["worker"]
        step += 1
    if schedule:
        raise RuntimeError(f"the run ended with {schedule} still to do: more steps")
    return plan


def report(rows: list[dict]) -> dict:
    """The summary of the steps that count (they started with every worker serving)."""
    counted = [row for row in rows if row["cause"] in CAUSES and row["workers"] == WORKERS]

    def of(cause: str, key: str) -> list:
        return [row[key] for row in counted if row["cause"] == cause]

    baseline = statistics.median(of("none", "rollout_s")) if of("none", "rollout_s") else None
    out: dict = {}
    for cause in CAUSES[1:]:
        losses = of(cause, "recovery")
        out[f"recovery_{cause}_s"] = distribution(loss["recovery_s"] for loss in losses)
        out[f"migrated_{cause}_s"] = distribution(loss["migrated_s"] for loss in losses)
        delays = [s - baseline for s in of(cause, "rollout_s")] if baseline is not None else []
        out[f"step_delay_{cause}_s"] = round(statistics.median(delays), 3) if delays else None
        out[f"held_{cause}"] = sum(loss["held"] for loss in losses)
        out[f"unresolved_{cause}"] = sum(loss["unresolved"] for loss in losses)
    out["baseline_step_s"] = round(baseline, 3) if baseline is not None else None
    out["baseline_steps"] = len(of("none", "rollout_s"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="of none, kill, notice")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the schedule")
    parser.add_argument("--model", default=".spotrl/models/arithmetic-base")
    parser.add_argument("--kill-at", type=float, default=0.5, help="share of the step's tokens")
    parser.add_argument("--heartbeat-ttl-s", type=float, default=5.0, help="the worker default")
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="the worker default")
    parser.add_argument("--grace-s", type=float, default=25.0, help="the notice's grace period")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--step-delay-ms", type=float, default=20.0)
    parser.add_argument("--work-dir", type=Path, help="keep the services' logs here")
    args = parser.parse_args()
    model = ensure_model(Path(args.model), "arithmetic", None, 1000)
    # enough for a replacement to take several steps to join; cancelled once the schedule is done
    steps = args.warmup + 20 * args.rounds
    spec = bench_spec(model, steps, args.max_new_tokens)
    step_tokens = (
        spec.training.prompts_per_step * spec.training.group_size * spec.sampling.max_new_tokens
    )
    worker_env = settings_env(
        RolloutSettings,
        step_delay_ms=args.step_delay_ms,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        heartbeat_s=args.heartbeat_s,
        preempt_grace_s=args.grace_s,
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spotrl-bench-recovery-") as tmp:
        config = DeploymentConfig(
            args.work_dir or Path(tmp),
            reserved=0,
            preemptible=WORKERS,
            worker_slots=32,
            flush_tokens=4,
            worker_env=worker_env,
        )
        with Deployment(config) as dep, CoordinatorClient(dep.coordinator_url) as client:
            r = redis.Redis.from_url(dep.redis_url)
            run_id = client.submit(spec.model_dump(mode="json"))
            plan = drive(dep, r, run_id, args, step_tokens)
            client.cancel(run_id)
            run = wait_final(client, run_id, 600)
            trained = int(cast(bytes, r.hget(keys.trainer_state(run_id), "steps_trained")) or 0)
            audit = audit_run(dep.redis_url, run_id, spec, steps=trained)
            r.close()
            rows = []
            for row in client.metrics(run_id):
                got = plan.get(row["step"], {"cause": "settle"})
                rows.append(
                    got
                    | {
                        "step": row["step"],
                        "rollout_s": row["rollout_s"],
                        "workers": row["workers_preemptible"],
                        "migrations": row["migrations"],
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    summary = report(rows) | {
        "state": run["state"],  # cancelled once the schedule is done
        "lost": audit["lost"],
        "duplicated": audit["duplicated"],
        "steps_trained": trained,
        "rounds": args.rounds,
        "heartbeat_ttl_s": args.heartbeat_ttl_s,
        "heartbeat_s": args.heartbeat_s,
        "preempt_grace_s": args.grace_s,
        "kill_at": args.kill_at,
        "step_delay_ms": args.step_delay_ms,
        "max_new_tokens": args.max_new_tokens,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

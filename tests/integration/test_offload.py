"""Adaptive offload with real processes: with no preemptible worker the reserved pool does all
of the rollout; with one reserved and two preemptible workers the reserved one seeds for T_seed,
steps aside, and its requests continue on the preemptible pool as seeds."""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.contracts import keys
from services.contracts.runspec import RunSpec
from tests.harness.deploy import Deployment, DeploymentConfig
from tests.integration.conftest import read_groups, small_spec, wait_final, wait_until


def run_on(tmp_path, model, reserved, preemptible, spec, env=None, slots=8):
    with Deployment(
        DeploymentConfig(
            tmp_path,
            reserved=reserved,
            preemptible=preemptible,
            worker_slots=slots,
            flush_tokens=2,
            extra_env=env or {},
        )
    ) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        run_id = client.submit(spec)
        run = wait_final(client, dep, run_id, timeout_s=300)
        rows = client.metrics(run_id)
        audit = audit_run(dep.redis_url, run_id, RunSpec.model_validate(spec))
        r = redis.Redis.from_url(dep.redis_url)
        groups = read_groups(dep, run_id)
        r.close()
        return run, rows, audit, groups


def all_delivered(r, stream) -> bool:
    """Every entry of the jobs stream was read by a worker (none waits in the stream)."""
    last = r.xrevrange(stream, count=1)
    for group in r.xinfo_groups(stream):
        if group["name"] == keys.WORKERS_GROUP.encode():
            return bool(last) and group["last-delivered-id"] == last[0][0]
    return False


def test_spotrl_up_with_no_preemptible_worker_completes(tmp_path, tiny_model):
    """The reserved pool does all of the rollout (a co-located framework)."""
    env = {**os.environ, "SPOTRL_HOME": str(tmp_path)}
    cmd = [
        sys.executable,
        "-m",
        "services.cli.main",
        "up",
        "--steps",
        "2",
        "--preemptible",
        "0",
        "--model",
        str(tiny_model),
        "--prompts-per-step",
        "4",
        "--group-size",
        "2",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["state"] == "succeeded" and summary["steps"] == 2
    assert summary["groups_incomplete"] == 0 and summary["lost"] == 0
    assert summary["duplicated"] == 0 and summary["migrations"] == {}
    rows = json.loads(Path(summary["metrics_file"]).read_text())
    assert all(r["workers_preemptible"] == 0 and r["t_seed_s"] is None for r in rows)


def test_reserved_worker_seeds_then_steps_aside(tmp_path, tiny_model):
    spec = small_spec(
        tiny_model, steps=3, prompts_per_step=4, group_size=4, max_new_tokens=96, ignore_eos=True
    )
    env = {"SPOTRL_STEP_DELAY_MS": "40"}  # a response takes ~4 s, longer than the 2 s window
    # 4 slots a worker: the two preemptible workers can hold 8 of a step's 16 requests, so the
    # reserved one finds work whichever worker loads the step's weights first
    run, rows, audit, groups = run_on(
        tmp_path, tiny_model, reserved=1, preemptible=2, spec=spec, env=env, slots=4
    )
    assert run["state"] == "succeeded" and audit["lost"] == 0 and audit["duplicated"] == 0
    assert all(len(g.responses) == spec["group_size"] for g in groups)
    seeds = sum(row["migrations"].get("seed", 0) for row in rows)
    assert seeds > 0
    first = rows[0]
    assert first["workers_reserved"] == 1 and first["workers_preemptible"] == 2
    assert first["t_seed_s"] == pytest.approx(2.0)
    assert first["seed_wait_s"] >= 1.9  # the trainer waited for the reserved pool to step aside
    assert "t_remote_wait_s" in first and first["n_prem_recommended"] > 0
    assert rows[1]["t_seed_s"] == pytest.approx(first["t_seed_next_s"])
    assert run["t_seed_s"] is not None and run["n_prem_recommended"] > 0
    # the pool a scaler should hold: the mean N_prem of the last 3 steps times the headroom
    headroom = RunSpec.model_validate(spec).rollout.pool_headroom
    recent = [row["n_prem_recommended"] for row in rows[-3:]]
    wanted = max(1, math.ceil(sum(recent) / len(recent) * headroom))
    assert run["preemptible_wanted"] == wanted, (run, recent)


def test_overloaded_worker_releases_its_surplus_to_an_idle_one(tmp_path, tiny_model):
    """One worker takes every job before it knows its plateau; once measured (the emulated step
    cost grows with the batch, so throughput saturates near 8) it holds more than its plateau
    while the other worker idles with nothing queued: the surplus migrates (Algorithm 2)."""
    spec = small_spec(
        tiny_model,
        steps=2,
        prompts_per_step=6,
        group_size=4,
        max_new_tokens=48,
        # every request runs its whole budget: the worker holds its 24 long enough to measure
        # its plateau (with free lengths most ended first on a busy machine, and none moved)
        ignore_eos=True,
        temperature=2.0,
        fair_reads=False,  # Algorithm 2 as the paper states it: the surplus over the plateau
    )
    env = {
        "SPOTRL_STEP_DELAY_MS": "20",
        "SPOTRL_STEP_DELAY_PER_REQUEST_MS": "20",
        "SPOTRL_HEARTBEAT_S": "0.2",
        "SPOTRL_HEARTBEAT_TTL_S": "30",  # the first worker is stopped a while (below), not dead
        "SPOTRL_SLOTS": "24",
    }
    with Deployment(
        DeploymentConfig(
            tmp_path, reserved=0, preemptible=1, worker_slots=24, flush_tokens=2, extra_env=env
        )
    ) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        r = redis.Redis.from_url(dep.redis_url)
        run_id = client.submit(spec)
        jobs = keys.jobs_stream(run_id, 0)
        n_jobs = spec["prompts_per_step"] * spec["group_size"]
        wait_until(  # the first worker has read every job of step 0
            lambda: r.exists(jobs) and r.xlen(jobs) >= n_jobs and all_delivered(r, jobs),
            "the first worker did not read every job of step 0",
            120,
        )
        # the first worker waits, stopped, until the second has loaded v0: a second worker
        # takes seconds to start and load, and step 0 must not end before it can take work
        first = dep.procs["rollout-preemptible-1"]
        first.popen.send_signal(signal.SIGSTOP)
        try:
            second = dep.add_worker("preemptible", SLOTS="24")
            wait_until(
                lambda: r.sismember(keys.worker_loads(run_id, second.name), 0),
                "the second worker never loaded v0",
                120,
            )
        finally:
            first.popen.send_signal(signal.SIGCONT)
        run = wait_final(client, dep, run_id, timeout_s=300)
        assert run["state"] == "succeeded" and run["groups_incomplete"] == 0
        audit = audit_run(dep.redis_url, run_id, RunSpec.model_validate(spec))
        assert audit["lost"] == 0 and audit["duplicated"] == 0
        rows = client.metrics(run_id)
        assert sum(row["migrations"].get("balance", 0) for row in rows) > 0, rows

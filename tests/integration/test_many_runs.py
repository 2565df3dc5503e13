"""Several runs on one fleet (issue 52), every service a real process: a coordinator that may
keep three runs active, a pool of two trainers, three workers. Two runs train at once, each by
its own trainer, the workers placed among them by the fleet's shares (each serves one run at a
time and moves when the shares say so); a third run waits in the queue while both trainers are
busy and runs when one is free. Every run succeeds with nothing lost or duplicated."""

import json
import re
import time
from dataclasses import replace

import pytest
import redis

from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.contracts import keys
from services.contracts.messages import Heartbeat
from services.contracts.runspec import RunSpec
from tests.harness.deploy import Deployment, DeploymentConfig
from tests.integration.conftest import (
    heartbeats_of,
    lora_specs,
    small_spec,
    wait_final,
    wait_until,
)

pytestmark = pytest.mark.slow


def fleet_config(tmp_path, workers: int, max_active_runs: int) -> DeploymentConfig:
    """Spot workers of 8 slots and two trainers under a coordinator that keeps up to
    `max_active_runs` runs active, placing the fleet every 0.3 s."""
    return DeploymentConfig(
        tmp_path,
        reserved=0,
        preemptible=workers,
        worker_slots=8,
        trainers=2,
        extra_env={
            "SPOTRL_MAX_ACTIVE_RUNS": str(max_active_runs),
            "SPOTRL_PLACEMENT_S": "0.3",
        },
        # decode steps of 20 ms at least: the runs' rollouts overlap in time
        worker_env={"SPOTRL_STEP_DELAY_MS": "20"},
    )


def test_two_runs_train_at_once_on_one_fleet_and_a_third_waits_for_a_trainer(tmp_path, tiny_model):
    config = fleet_config(tmp_path, workers=3, max_active_runs=3)
    specs = [
        small_spec(tiny_model, steps=4, seed=seed, learning_rate=lr)
        for seed, lr in ((1, 1e-4), (2, 3e-4), (3, 1e-4))
    ]
    specs[1]["share"] = 2.0  # the second weighs twice the first
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        first, second = client.submit(specs[0]), client.submit(specs[1])

        def both_running() -> bool:
            return all(client.run(r)["state"] == "running" for r in (first, second))

        wait_until(both_running, "the two runs active at once", 120)
        rdb = redis.Redis.from_url(dep.redis_url)

        def trainers_say() -> list[str]:
            beats = rdb.mget([keys.trainer_heartbeat(t) for t in ("trainer", "trainer-2")])
            return sorted((json.loads(b)["run_id"] or "") if b else "" for b in beats)

        wait_until(
            lambda: trainers_say() == sorted((first, second)),
            lambda: f"the trainers train {trainers_say()}",
            60,
        )
        third = client.submit(specs[2])
        # a third run may be active, but no trainer is idle for it: it waits (several polls)
        for _ in range(10):
            assert client.run(third)["state"] == "queued"
            time.sleep(0.1)
        served: set[tuple[str, str]] = set()

        def both_served() -> bool:
            for w in client.workers():
                if w["alive"] and w["run_id"] in (first, second):
                    served.add((w["id"], w["run_id"]))
            return {run for _, run in served} == {first, second}

        wait_until(both_served, lambda: f"workers served only {served}", 120)
        # the API says each active run's share and the workers serving it
        fleet = client.http.get("/v1/fleet").json()
        shares = {first: 1.0, second: 2.0, third: 1.0}
        assert fleet["runs"] and all(run["share"] == shares[run["id"]] for run in fleet["runs"])
        assert 1 <= sum(run["workers"] for run in fleet["runs"]) <= 3, fleet
        runs = {r: wait_final(client, dep, r, timeout_s=300) for r in (first, second, third)}
        for run_id, spec in zip((first, second, third), specs, strict=True):
            assert runs[run_id]["state"] == "succeeded", runs[run_id]
            audit = audit_run(dep.redis_url, run_id, RunSpec.model_validate(spec))
            assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
        # the two ran side by side; the third began only once one of them had ended
        a, b, c = (runs[r] for r in (first, second, third))
        assert max(a["started_at"], b["started_at"]) < min(a["finished_at"], b["finished_at"])
        assert c["started_at"] >= min(a["finished_at"], b["finished_at"])


def test_runs_on_two_base_models_share_one_fleet(tmp_path, tiny_model, tiny_model_b):
    """Two runs on different base models (other shapes) on one fleet of two workers: the shares
    place a worker that holds the first base on the second run, whose engine builds that model
    (it cannot load those weights in place), and back when a run ends; both runs succeed,
    exact, and no worker died of the switch."""
    config = fleet_config(tmp_path, workers=2, max_active_runs=2)
    specs = [
        # the first runs long enough that the second comes while it is still active
        small_spec(tiny_model, steps=120, seed=1),
        small_spec(tiny_model_b, steps=4, seed=2),
    ]
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        rdb = redis.Redis.from_url(dep.redis_url)
        workers = ("rollout-preemptible-1", "rollout-preemptible-2")
        first = client.submit(specs[0])

        def loads(run_id: str) -> dict[str, set[bytes]]:
            return {w: rdb.smembers(keys.worker_loads(run_id, w)) for w in workers}

        # both workers hold the first base before the second run comes
        wait_until(lambda: all(loads(first).values()), lambda: f"loads {loads(first)}", 120)
        second = client.submit(specs[1])
        runs = {r: wait_final(client, dep, r, timeout_s=300) for r in (first, second)}
        for run_id, spec in zip((first, second), specs, strict=True):
            assert runs[run_id]["state"] == "succeeded", runs[run_id]
            audit = audit_run(dep.redis_url, run_id, RunSpec.model_validate(spec))
            assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
        # a worker that held the first base loaded the second run's versions: its engine
        # built the other model, and lived on
        switched = [w for w in workers if loads(second)[w]]
        assert switched, loads(second)
        for w in switched:
            assert "weights of another model" in dep.procs[w].log_path.read_text(), w
        dep.check_alive()
        # the move from the first run (still active then) was the shares', and counted
        metrics = client.http.get("/metrics").text
        switches = re.search(r"^spotrl_coordinator_worker_switches_total (\S+)$", metrics, re.M)
        assert switches and float(switches.group(1)) >= 1, switches


def test_one_engine_serves_three_lora_runs_and_a_kill_loses_none_of_them(tmp_path, tiny_model):
    """Three LoRA runs on one base, two workers that serve up to three runs at once on their
    one engine (SPOTRL_RUNS_AT_ONCE=3): each worker's heartbeat names all three, a worker is
    SIGKILLed while it holds requests of all three, and the three runs succeed with nothing
    lost or duplicated, the other worker serving them on."""
    steps = 8
    config = fleet_config(tmp_path, workers=2, max_active_runs=3)
    config = replace(
        config,
        trainers=3,
        worker_slots=16,
        worker_env={
            "SPOTRL_STEP_DELAY_MS": "40",
            "SPOTRL_RUNS_AT_ONCE": "3",
            "SPOTRL_MAX_LORAS": "6",
        },
    )
    specs = lora_specs(tiny_model, steps, ((1, 1e-3), (2, 2e-3), (3, 5e-4)))
    workers = ("rollout-preemptible-1", "rollout-preemptible-2")
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        rdb = redis.Redis.from_url(dep.redis_url)
        runs = [client.submit(spec) for spec in specs]

        def beats() -> dict[str, Heartbeat]:
            return heartbeats_of(rdb, workers)

        wait_until(
            lambda: (
                all(sorted(b.served_runs) == sorted(runs) for b in beats().values())
                and len(beats()) == 2
            ),
            lambda: f"heartbeats {beats()}",
            180,
        )

        victim, held = dep.stop_a_holder(runs, steps, want=3)
        assert held == set(runs)
        dep.procs[victim].kill()
        finals = {r: wait_final(client, dep, r, timeout_s=300) for r in runs}
        for run_id, spec in zip(runs, specs, strict=True):
            assert finals[run_id]["state"] == "succeeded", finals[run_id]
            audit = audit_run(dep.redis_url, run_id, RunSpec.model_validate(spec))
            assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
        # the three ran side by side
        assert max(f["started_at"] for f in finals.values()) < min(
            f["finished_at"] for f in finals.values()
        )

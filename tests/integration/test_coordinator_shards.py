"""Coordinator shards (issue 22): a run whose token deltas are collected by three coordinator
processes, each the groups of a third of every step's prompts, with its own deltas stream and
durable request table. Real processes, killed with SIGKILL mid-step: a shard (the coordinator
starts it again; it resumes from its table), a worker (shard 0 reclaims its jobs and hands
those of the other shards to them), and the coordinator (its shards die with it; the new one
starts new ones). The run must end with every group of exactly n responses, none twice, and a
metrics row per step that adds up every shard's part."""

import psutil
import pytest

from services.cli.audit import audit_run
from services.contracts import keys
from services.contracts.messages import Job
from services.contracts.runspec import RunSpec
from services.contracts.shards import shard_of
from tests.harness.deploy import DeploymentConfig

from .conftest import deploy_config, read_groups, run_events, small_spec, wait_final, wait_until

SHARDS = 3
STEPS = 4
PROMPTS = 9
HEARTBEAT_TTL_S = 2.0


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return deploy_config(
        tmp_path_factory.mktemp("shards"),
        preemptible=2,
        flush_tokens=1,
        extra_env={
            "SPOTRL_STEP_DELAY_MS": "120",
            "SPOTRL_HEARTBEAT_S": "0.3",
            "SPOTRL_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S),
        },
    )


def shard_processes(deployment, run_id: str) -> dict[int, psutil.Process]:
    """The coordinator's shard processes of the run, by shard (zombies left out)."""
    out = {}
    try:
        children = psutil.Process(deployment.procs["coordinator"].pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    for child in children:
        try:
            cmd = child.cmdline()
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        if "services.coordinator.run.shard" in cmd and run_id in cmd:
            out[int(cmd[-1])] = child
    return out


def published(rdb, run_id: str, step: int) -> int:
    return sum(rdb.scard(keys.step_published(run_id, step, i)) for i in range(SHARDS))


def wait_mid_step(rdb, run_id: str, timeout_s: float = 120.0) -> int:
    """The step under way once some, not all, of its groups went to the trainer."""
    found: list[int] = []

    def mid() -> bool:
        raw = rdb.get(keys.run_version(run_id))
        if raw is None:
            return False
        step = int(raw)
        if 0 < published(rdb, run_id, step) < PROMPTS:
            found.append(step)
            return True
        return False

    wait_until(mid, "never caught the run mid-step", timeout_s, 0.02)
    return found[-1]


def wait_past(rdb, run_id: str, step: int, timeout_s: float = 120.0) -> None:
    wait_until(
        lambda: int(rdb.get(keys.run_version(run_id)) or 0) > step,
        f"the run never got past step {step}",
        timeout_s,
        0.05,
    )


def holder_of_other_shards(rdb, run_id: str, step: int) -> str | None:
    """A preemptible worker that holds a job of shard 1 or 2 of the step, if one does."""
    jobs = keys.jobs_stream(run_id, step)
    for entry in rdb.xpending_range(jobs, keys.WORKERS_GROUP, "-", "+", 1000):
        worker = entry["consumer"].decode()
        if "preemptible" not in worker:
            continue
        found = rdb.xrange(jobs, entry["message_id"], entry["message_id"])
        if found and shard_of(Job.from_fields(found[0][1]).request_id, SHARDS) != 0:
            return worker
    return None


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_three_shards_survive_a_shard_a_worker_and_the_coordinator_killed(
    deployment, client, rdb, tiny_model
):
    body = small_spec(
        tiny_model,
        steps=STEPS,
        prompts_per_step=PROMPTS,
        max_new_tokens=8,
        coordinator_shards=SHARDS,
    )
    run_id = client.submit(body)
    first = wait_until(
        lambda: (lambda found: found if len(found) == SHARDS - 1 else None)(
            shard_processes(deployment, run_id)
        ),
        "the coordinator never started its shards",
        60,
    )
    coordinator_log = deployment.log_dir / "coordinator.log"

    # a shard killed mid-step: the coordinator starts it again, and it resumes its table
    step = wait_mid_step(rdb, run_id)
    first[1].kill()
    wait_until(
        lambda: "coordinator shard 1 died" in coordinator_log.read_text(),
        "the coordinator never noticed its shard die",
        30,
    )
    wait_until(
        lambda: (lambda s: s[1] if 1 in s and s[1].pid != first[1].pid else None)(
            shard_processes(deployment, run_id)
        ),
        "shard 1 was never started again",
        30,
    )
    wait_past(rdb, run_id, step)

    # a worker killed mid-step: shard 0 reclaims its jobs, the other shards' by handing them on
    step = wait_mid_step(rdb, run_id)
    name = wait_until(
        lambda: holder_of_other_shards(rdb, run_id, step),
        "no preemptible worker held another shard's job",
        60,
        0.01,
    )
    victim = deployment.procs[name]
    victim.kill()
    wait_until(
        lambda: [
            e for e in run_events(rdb, run_id, "worker_reclaimed") if e["worker"] == victim.name
        ],
        f"the coordinator never reclaimed the jobs of {victim.name}",
        60,
    )
    wait_past(rdb, run_id, step)

    # the coordinator killed mid-step: its shards die with it, the new one starts its own
    step = wait_mid_step(rdb, run_id)
    before = shard_processes(deployment, run_id)
    deployment.restart("coordinator", kill=True)
    wait_until(lambda: all(gone(p) for p in before.values()), "shards outlived the coordinator", 10)
    wait_past(rdb, run_id, step)

    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded", run["error"]
    audit = audit_run(deployment.redis_url, run_id, RunSpec.model_validate(body))
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
    assert int(rdb.hget(keys.trainer_state(run_id), "steps_trained")) == STEPS
    assert run["groups_incomplete"] == 0

    groups = read_groups(deployment, run_id)
    rows = client.metrics(run_id)
    assert [row["step"] for row in rows] == list(range(STEPS))
    for row in rows:  # each row adds up the three shards' tables
        step_groups = [g for g in groups if g.step == row["step"]]
        assert len(step_groups) == PROMPTS
        tokens = sum(len(r.token_ids) for g in step_groups for r in g.responses)
        assert row["response_tokens"] == tokens, row
    assert sum(row["migrations"].get("death", 0) for row in rows) >= 1
    log = coordinator_log.read_text()
    assert "by other shards)" in log and "resumed:" in log
    handed = [
        int(line.rsplit("(", 1)[1].split()[0])
        for line in log.splitlines()
        if "missed its heartbeat" in line
    ]
    assert sum(handed) >= 1, handed  # the dead worker held other shards' requests too
    # shard processes log to the coordinator's log, each with its own name
    assert "coordinator-shard-1 " in log and "coordinator-shard-2 " in log
    # the shard started again took its step up from its durable table
    lines = log.splitlines()
    assert any("coordinator-shard-1 " in line and "resumed:" in line for line in lines)

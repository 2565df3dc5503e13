"""Preemption with real processes: workers get SIGKILL, SIGTERM (the notice) or SIGSTOP (frozen
past their heartbeat, then back) in the middle of generation. Every run must complete with
exactly n responses per group, and the responses of step 0 (weights v0, seeded sampling) must
be token for token those of an undisturbed run: migrated requests continue from what was
collected, with no token appended twice and none skipped."""

import signal
import time

import pytest
import redis

from services.cli.deploy import DeploymentConfig
from services.common import keys
from tests.integration.conftest import read_groups, small_spec, wait_final

pytestmark = pytest.mark.slow
HEARTBEAT_TTL_S = 1.5


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory):
    """Three preemptible workers with a short heartbeat, for conftest's `deployment`."""
    env = {
        "SPOTRL_HEARTBEAT_S": "0.3",
        "SPOTRL_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S),
        "SPOTRL_STEP_DELAY_MS": "40",
        "SPOTRL_PREEMPT_GRACE_S": "5",
    }
    return DeploymentConfig(
        tmp_path_factory.mktemp("preempt"),
        reserved=0,
        preemptible=3,
        worker_slots=4,
        flush_tokens=2,
        extra_env=env,
    )


def spec(model):
    return small_spec(
        model, group_size=3, prompts_per_step=4, steps=2, max_new_tokens=36, ignore_eos=True
    )


def responses_of_step(rdb, run_id, step):
    return {
        (g.prompt_index, i): r.token_ids
        for g in read_groups(rdb, run_id)
        if g.step == step
        for i, r in enumerate(g.responses)
    }


def check_groups(rdb, run_id, s):
    groups = read_groups(rdb, run_id)
    assert len(groups) == s["steps"] * s["prompts_per_step"]
    assert len({(g.step, g.prompt_index) for g in groups}) == len(groups)
    for g in groups:
        assert len(g.responses) == s["group_size"]
        for r in g.responses:
            assert len(r.token_ids) == len(r.logprobs) == s["max_new_tokens"]
    return groups


@pytest.fixture(scope="module")
def reference(deployment, client, rdb, tiny_model):
    run_id = client.submit(spec(tiny_model))
    assert wait_final(client, deployment, run_id)["state"] == "succeeded"
    return responses_of_step(rdb, run_id, 0)


def holders(rdb, run_id):
    """Workers holding jobs of step 0 right now, by name."""
    stream = keys.jobs_stream(run_id, 0)
    try:
        consumers = rdb.xinfo_consumers(stream, keys.WORKERS_GROUP)
    except redis.ResponseError:
        return []
    return [
        c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
        for c in consumers
        if c["pending"] > 0
    ]


def wait_mid_generation(rdb, run_id, min_deltas=6, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            rdb.exists(keys.deltas_stream(run_id))
            and rdb.xlen(keys.deltas_stream(run_id)) >= min_deltas
        ):
            busy = holders(rdb, run_id)
            if len(busy) >= 2:
                return busy
        time.sleep(0.02)
    raise TimeoutError("generation did not start")


def test_kill_and_notice_mid_generation_lose_nothing(
    deployment, client, rdb, tiny_model, reference
):
    s = spec(tiny_model)
    run_id = client.submit(s)
    busy = wait_mid_generation(rdb, run_id)
    deployment.procs[busy[0]].kill()  # SIGKILL: no notice, found by its missed heartbeat
    deployment.procs[busy[1]].popen.send_signal(signal.SIGTERM)  # notice: flush, release, exit
    run = wait_final(client, deployment, run_id, timeout_s=120)
    assert run["state"] == "succeeded" and run["groups_incomplete"] == 0
    assert deployment.procs[busy[1]].popen.wait(10) is not None  # left within its grace period
    check_groups(rdb, run_id, s)
    assert responses_of_step(rdb, run_id, 0) == reference
    row = client.metrics(run_id)[0]
    assert row["migrations"].get("death", 0) >= 1 and row["migrations"].get("preemption", 0) >= 1
    assert row["regenerated_tokens"] == 0  # nothing flushed was generated again
    migrated = [
        r for g in read_groups(rdb, run_id) if g.step == 0 for r in g.responses if r.leases > 1
    ]
    assert migrated
    for name in busy[:2]:
        del deployment.procs[name]
    deployment.add_worker("preemptible")
    deployment.add_worker("preemptible")


def test_frozen_worker_that_comes_back_is_fenced(deployment, client, rdb, tiny_model, reference):
    s = spec(tiny_model)
    run_id = client.submit(s)
    busy = wait_mid_generation(rdb, run_id)
    frozen = deployment.procs[busy[0]]
    frozen.popen.send_signal(signal.SIGSTOP)
    time.sleep(HEARTBEAT_TTL_S + 1.5)  # declared dead, its requests migrated
    frozen.popen.send_signal(signal.SIGCONT)  # back, still holding stale leases
    run = wait_final(client, deployment, run_id, timeout_s=120)
    assert run["state"] == "succeeded"
    check_groups(rdb, run_id, s)
    assert responses_of_step(rdb, run_id, 0) == reference
    row = client.metrics(run_id)[0]
    assert row["migrations"].get("death", 0) >= 1
    assert frozen.alive()
    log = frozen.log_path.read_text()
    if row["stale_deltas"] > 0:  # it flushed old-lease tokens: it must have been told to drop
        assert "it was migrated" in log

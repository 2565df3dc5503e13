"""Preemption with real processes: workers get SIGKILL, SIGTERM (the notice) or SIGSTOP (frozen
past their heartbeat, then back) in the middle of generation. Every run must complete with
exactly n responses per group, and the responses of step 0 (weights v0, seeded sampling) must
be token for token those of an undisturbed run: migrated requests continue from what was
collected, with no token appended twice and none skipped."""

import signal
from pathlib import Path

import pytest
import redis

from services.cli.procs import Proc
from services.contracts import keys
from services.contracts.messages import Job
from tests.integration.conftest import (
    collected,
    finished_requests,
    read_groups,
    run_events,
    short_heartbeat_config,
    small_spec,
    wait_final,
    wait_until,
)

HEARTBEAT_TTL_S = 1.5
MAX_NEW_TOKENS = 36
# A worker is caught with this many tokens still to generate at least: a notice (SIGTERM) lands
# in the middle of generation, well before the worker could finish what it holds.
MARGIN_TOKENS = 12


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory):
    """Three preemptible workers with a short heartbeat, for conftest's `deployment`."""
    return short_heartbeat_config(tmp_path_factory.mktemp("preempt"), 3, HEARTBEAT_TTL_S)


def spec(model):
    return small_spec(
        model,
        group_size=3,
        prompts_per_step=4,
        steps=2,
        max_new_tokens=MAX_NEW_TOKENS,
        ignore_eos=True,
    )


def responses_of_step(deployment, run_id, step):
    return {
        (g.prompt_index, i): r.token_ids
        for g in read_groups(deployment, run_id)
        if g.step == step
        for i, r in enumerate(g.responses)
    }


def check_groups(deployment, run_id, s):
    groups = read_groups(deployment, run_id)
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
    return responses_of_step(deployment, run_id, 0)


def holders(rdb, run_id):
    """Workers holding jobs of step 0 right now (read, not acknowledged), by name."""
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


def unfinished_held(rdb, run_id, worker) -> set[str]:
    """Requests of step 0 that `worker` holds with MARGIN_TOKENS or more still to generate."""
    stream = keys.jobs_stream(run_id, 0)
    pending = rdb.xpending_range(
        stream, keys.WORKERS_GROUP, min="-", max="+", count=1000, consumername=worker
    )
    held = set()
    for entry in pending:
        for _, fields in rdb.xrange(stream, entry["message_id"], entry["message_id"]):
            job = Job.from_fields(fields)
            held.add((job.request_id, job.lease))
    have = collected(rdb, run_id, 0)
    return {
        request_id
        for request_id, lease in held - finished_requests(rdb, run_id, 0)
        if MAX_NEW_TOKENS - have.get(request_id, 0) >= MARGIN_TOKENS
    }


def is_stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")


def freeze_a_holder(deployment, rdb, run_id, exclude=(), min_tokens=6, timeout_s=60) -> Proc:
    """SIGSTOP a live worker in the middle of generating step 0, and return it stopped.

    A worker seen holding jobs may finish them before the signal lands; once stopped it changes
    nothing, so it is checked again then: if it holds no unfinished request it is resumed and
    another one is tried."""

    def attempt() -> Proc | None:
        if sum(collected(rdb, run_id, 0).values()) < min_tokens:
            return None
        for name in holders(rdb, run_id):
            proc = deployment.procs.get(name)
            if name in exclude or proc is None or not proc.alive():
                continue
            proc.popen.send_signal(signal.SIGSTOP)
            wait_until(lambda p=proc: is_stopped(p.pid), f"{name} did not stop", 10, 0.001)
            if unfinished_held(rdb, run_id, name):
                return proc
            proc.popen.send_signal(signal.SIGCONT)
        return None

    return wait_until(
        attempt,
        lambda: f"no worker caught generating step 0 (holders: {holders(rdb, run_id)})",
        timeout_s,
    )


def wait_reclaimed(rdb, run_id, worker, timeout_s=60):
    """Until the coordinator has declared `worker` dead and migrated its requests."""
    return wait_until(
        lambda: [e for e in run_events(rdb, run_id, "worker_reclaimed") if e["worker"] == worker],
        f"the coordinator never reclaimed the jobs of {worker}",
        timeout_s,
    )


def test_kill_and_notice_mid_generation_lose_nothing(
    deployment, client, rdb, tiny_model, reference
):
    s = spec(tiny_model)
    run_id = client.submit(s)
    killed = freeze_a_holder(deployment, rdb, run_id)
    killed.kill()  # SIGKILL: no notice, found by its missed heartbeat
    # another worker holding requests: its own, or the killed one's once migrated
    noticed = freeze_a_holder(deployment, rdb, run_id, exclude={killed.name})
    noticed.popen.send_signal(signal.SIGTERM)  # notice: flush, release, exit
    noticed.popen.send_signal(signal.SIGCONT)
    run = wait_final(client, deployment, run_id, timeout_s=120)
    assert run["state"] == "succeeded" and run["groups_incomplete"] == 0
    assert noticed.popen.wait(10) is not None  # left within its grace period
    check_groups(deployment, run_id, s)
    assert responses_of_step(deployment, run_id, 0) == reference
    row = client.metrics(run_id)[0]
    assert row["migrations"].get("death", 0) >= 1 and row["migrations"].get("preemption", 0) >= 1
    assert row["regenerated_tokens"] == 0  # nothing flushed was generated again
    migrated = [
        r
        for g in read_groups(deployment, run_id)
        if g.step == 0
        for r in g.responses
        if r.leases > 1
    ]
    assert migrated
    for proc in (killed, noticed):
        del deployment.procs[proc.name]
    deployment.add_worker("preemptible")
    deployment.add_worker("preemptible")


def test_frozen_worker_that_comes_back_is_fenced(deployment, client, rdb, tiny_model, reference):
    s = spec(tiny_model)
    run_id = client.submit(s)
    frozen = freeze_a_holder(deployment, rdb, run_id)
    wait_reclaimed(rdb, run_id, frozen.name)  # declared dead, its requests migrated
    frozen.popen.send_signal(signal.SIGCONT)  # back, still holding stale leases
    run = wait_final(client, deployment, run_id, timeout_s=120)
    assert run["state"] == "succeeded"
    check_groups(deployment, run_id, s)
    assert responses_of_step(deployment, run_id, 0) == reference
    row = client.metrics(run_id)[0]
    assert row["migrations"].get("death", 0) >= 1
    assert frozen.alive()
    log = frozen.log_path.read_text()
    if row["stale_deltas"] > 0:  # it flushed old-lease tokens: it must have been told to drop
        assert "it was migrated" in log

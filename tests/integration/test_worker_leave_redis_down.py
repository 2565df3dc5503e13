"""A worker told to stop while Redis is unreachable still exits within its grace period: it
cannot release what it holds (the coordinator reclaims that by its missed heartbeat once Redis
is back), but no step of its leaving (the release, the withdrawal from its peers, the leaving
key, closing Redis, closing the engine) may wait past the deadline. The run then ends exact."""

import os
import signal
import subprocess
import time
from collections.abc import Callable

import pytest

from services.cli.audit import audit_run
from services.contracts.runspec import RunSpec
from tests.integration.conftest import (
    holds_unfinished_jobs,
    short_heartbeat_config,
    small_spec,
    wait_final,
    wait_until,
)

GRACE_S = 3.0
# the process's own start of shutdown and its interpreter's exit, on a loaded machine
MARGIN_S = 3.0
WAIT_AT_MOST_S = 120.0  # how long the test waits for an exit, to report how late it was


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory):
    """One preemptible worker with a short grace period, on a Redis that keeps its data over a
    restart (its append-only file)."""
    return short_heartbeat_config(
        tmp_path_factory.mktemp("redis-down"), 1, grace_s=GRACE_S, redis_appendonly=True
    )


def freeze_redis(deployment, while_frozen: Callable[[], object]) -> None:
    """SIGSTOP Redis, call `while_frozen()`, SIGCONT it: connections open, nothing answered
    (a hung server, or a network that drops its packets)."""
    redis_proc = deployment.procs["redis"]
    os.kill(redis_proc.pid, signal.SIGSTOP)
    try:
        while_frozen()
    finally:
        os.kill(redis_proc.pid, signal.SIGCONT)


def stop_redis(deployment, while_stopped: Callable[[], object]) -> None:
    """Stop Redis (connections refused), call `while_stopped()`, start it again on its data."""
    deployment.restart_redis(while_down=while_stopped)


@pytest.mark.parametrize("redis_away", [stop_redis, freeze_redis], ids=["stopped", "frozen"])
def test_a_worker_told_to_stop_while_redis_is_away_exits_within_its_grace(
    deployment, client, rdb, tiny_model, redis_away
):
    body = small_spec(tiny_model, steps=1, prompts_per_step=2, max_new_tokens=24, ignore_eos=True)
    run_id = client.submit(body)
    worker = next(p for p in deployment.workers() if p.alive())
    wait_until(
        lambda: holds_unfinished_jobs(rdb, run_id, worker.name), "the worker never held a job"
    )
    exit_s: list[float] = []

    def notice_the_worker() -> None:
        started = time.monotonic()
        worker.preempt()  # SIGTERM, the notice, while Redis cannot answer
        try:
            worker.popen.wait(WAIT_AT_MOST_S)
        except subprocess.TimeoutExpired:
            worker.kill()
        exit_s.append(time.monotonic() - started)

    redis_away(deployment, notice_the_worker)
    log = worker.log_path.read_text()
    print(f"worker exited {exit_s[0]:.1f}s after SIGTERM, redis away (grace {GRACE_S}s)")
    assert exit_s[0] <= GRACE_S + MARGIN_S, f"exited after {exit_s[0]:.1f}s:\n{log[-3000:]}"
    assert "could not release" in log  # it tried, and said why it gave up

    # Redis is back: the coordinator reclaims what the worker held; the run ends exact
    del deployment.procs[worker.name]
    deployment.add_worker("preemptible")
    run = wait_final(client, deployment, run_id, timeout_s=180)
    assert run["state"] == "succeeded", run
    audit = audit_run(deployment.redis_url, run_id, RunSpec.model_validate(body))
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit

"""Fail, don't hang, with real processes: a run whose workers all die says it is stalled (and
why) within the heartbeat TTL + 5 s, runs again when a worker comes, and fails once stalled for
its stall_timeout_s; a poison request (fault injection: it crashes every worker it runs on) is
quarantined after K crashes, its group dropped and counted while every other group trains
exactly, or it fails the run. Workers that crash say why in GET /v1/workers. The tests start
replacement workers as a supervisor would."""

import time

import pytest

from services.cli import procs
from services.cli.audit import audit_run
from services.contracts import keys
from services.contracts.runspec import FINAL_STATES, RunSpec
from tests.integration.conftest import (
    collected,
    read_groups,
    run_events,
    short_heartbeat_config,
    small_spec,
    wait_final,
    wait_until,
)

HEARTBEAT_TTL_S = 1.5
POISON = "0:2:1"  # step 0, prompt 2, sample 1
K = 2


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory):
    """Two preemptible workers with a short heartbeat, for conftest's `deployment`."""
    return short_heartbeat_config(tmp_path_factory.mktemp("stall"), 2, HEARTBEAT_TTL_S)


def spec(model, **over):
    base = {"group_size": 3, "prompts_per_step": 4, "steps": 2, "max_new_tokens": 16}
    return small_spec(model, ignore_eos=True, **(base | over))


def wait_mid_step(rdb, run_id, step=0):
    """Tokens of `step` are flowing and some of its groups are still to come."""

    def mid():
        return (
            sum(collected(rdb, run_id, step).values()) >= 2
            and rdb.scard(keys.step_published(run_id, step)) < 4
        )

    wait_until(mid, "generation did not start", timeout_s=60)


def kill_workers(deployment) -> list[str]:
    names = [p.name for p in deployment.workers() if p.alive()]
    for name in names:
        deployment.procs.pop(name).kill()
    return names


def use_workers(deployment, n: int, fault: str = "") -> None:
    """Exactly `n` healthy workers, with the fault injection `fault` (none when empty): a test
    does not depend on what the tests before it left."""
    for p in deployment.workers():
        env = deployment.launch[p.name][1]
        if not p.alive() or env.get("SPOTRL_FAULT_CRASH_REQUESTS", "") != fault:
            deployment.procs.pop(p.name).stop()
    for p in deployment.workers()[n:]:
        deployment.procs.pop(p.name).stop()
    while len(deployment.workers()) < n:
        deployment.add_worker("preemptible", wait=False, fault_crash_requests=fault)
    procs.wait_healthy(deployment.workers())


def check_exact(deployment, client, run_id, body, quarantined=0):
    run = client.run(run_id)
    assert run["state"] == "succeeded", run["error"]
    audit = audit_run(deployment.redis_url, run_id, RunSpec.model_validate(body))
    assert audit["duplicated"] == 0, audit
    assert audit["lost"] == 0 and audit["groups_quarantined"] == quarantined, audit
    assert run["groups_incomplete"] == 0 and run["groups_quarantined"] == quarantined


def states(rdb, run_id):
    return [e["state"] for e in run_events(rdb, run_id, "state")]


def test_every_worker_killed_stalls_then_runs_again(deployment, client, rdb, tiny_model):
    use_workers(deployment, 2)
    body = spec(tiny_model)
    run_id = client.submit(body)
    wait_mid_step(rdb, run_id)
    killed = kill_workers(deployment)
    killed_at = time.monotonic()
    run = wait_until(
        lambda: (r := client.run(run_id))["state"] == "stalled" and r,
        lambda: f"not stalled: {client.run(run_id)}",
        timeout_s=HEARTBEAT_TTL_S + 5,
    )
    assert time.monotonic() - killed_at <= HEARTBEAT_TTL_S + 5
    assert run["stall_reason"].startswith("no live rollout worker able to serve version 0")
    assert f"{killed[0]} lost" in run["stall_reason"], run["stall_reason"]
    assert run["stalled_since"] is not None
    deployment.add_worker("preemptible")
    wait_until(lambda: client.run(run_id)["state"] != "stalled", "still stalled", timeout_s=30)
    assert wait_final(client, deployment, run_id, timeout_s=120)["state"] == "succeeded"
    check_exact(deployment, client, run_id, body)
    assert states(rdb, run_id) == ["running", "stalled", "running", "succeeded"]
    stalled = run_events(rdb, run_id, "state")[1]
    assert stalled["reason"] == run["stall_reason"]
    after = client.run(run_id)
    assert after["stall_reason"] == "" and after["stalled_since"] is None


def test_stalled_past_its_timeout_the_run_fails_with_the_reason(
    deployment, client, rdb, tiny_model
):
    use_workers(deployment, 1)
    run_id = client.submit(spec(tiny_model, stall_timeout_s=2))
    wait_mid_step(rdb, run_id)
    kill_workers(deployment)
    run = wait_final(client, deployment, run_id, timeout_s=HEARTBEAT_TTL_S + 30)
    assert run["state"] == "failed"
    assert run["error"].startswith("stalled for 2s (stall_timeout_s): no live rollout worker")
    assert states(rdb, run_id) == ["running", "stalled", "failed"]


def supervise(deployment, client, run_id, workers: int, **settings) -> tuple[dict, list[str]]:
    """Keep `workers` workers (with `settings`) alive until the run ends, as `spotrl up` would;
    the run and the names of the workers that died."""
    dead: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        deployment.check_alive()
        run = client.run(run_id)
        if run["state"] in FINAL_STATES:
            return run, dead
        for p in deployment.workers():
            if not p.alive():
                dead.append(deployment.procs.pop(p.name).name)
        for _ in range(workers - len(deployment.workers())):
            deployment.add_worker("preemptible", wait=False, **settings)
        time.sleep(0.1)
    raise TimeoutError(f"run {run_id} not finished: {client.run(run_id)}")


def test_a_poison_request_is_quarantined_and_the_rest_trains(deployment, client, rdb, tiny_model):
    use_workers(deployment, 2, fault=POISON)  # each crashes when it runs the poison request
    body = spec(tiny_model, max_new_tokens=8, max_request_crashes=K)
    run_id = client.submit(body)
    run, dead = supervise(deployment, client, run_id, 2, fault_crash_requests=POISON)
    assert run["state"] == "succeeded", run["error"]
    assert len(dead) == K  # the first crash may have had bystanders; the K-th was its own
    check_exact(deployment, client, run_id, body, quarantined=1)
    groups = read_groups(deployment, run_id)
    dropped = [g for g in groups if g.quarantined]
    assert [(g.step, g.prompt_index, len(g.responses)) for g in dropped] == [(0, 2, 0)]
    for g in groups:
        if not g.quarantined:
            assert len(g.responses) == body["group_size"]
            assert all(len(r.token_ids) == body["max_new_tokens"] for r in g.responses)
    assert client.metrics(run_id)[0]["groups_quarantined"] == 1
    assert int(rdb.hget(keys.trainer_state(run_id), "steps_trained")) == body["steps"]
    [event] = run_events(rdb, run_id, "quarantined")
    assert event["request"] == POISON and sorted(event["workers"]) == sorted(dead)
    crashed = run_events(rdb, run_id, "worker_crashed")
    assert {e["worker"] for e in crashed} == set(dead)
    errors = {w["id"]: w["last_error"] for w in client.workers()}
    for name in dead:
        assert f"fault injection: request {POISON} crashes this worker" in errors[name]


def test_a_poison_request_fails_the_run_when_told_to(deployment, client, rdb, tiny_model):
    use_workers(deployment, 2, fault=POISON)
    body = spec(tiny_model, max_new_tokens=8, max_request_crashes=K, on_poison="fail_run")
    run_id = client.submit(body)
    run, _ = supervise(deployment, client, run_id, 2, fault_crash_requests=POISON)
    assert run["state"] == "failed"
    assert run["error"].startswith(f"request {POISON} (step 0, prompt 2) crashed {K} workers")
    assert "fault injection" in run["error"]
    crashed = {e["worker"] for e in run_events(rdb, run_id, "worker_crashed")}
    assert len(crashed) == K and all(name in run["error"] for name in crashed)

"""Redis bounded by the step, with real processes: token deltas are deleted once stored, a step's
groups once its version is committed (a trainer killed mid-step still finds every group of its
step), and a Redis at its memory limit brakes the run with a reason, or holds writes back,
without a crash or a lost response."""

import pytest
import redis

from services.cli.audit import audit_run
from services.contracts import keys
from services.contracts.messages import Group
from services.contracts.runspec import RunSpec
from tests.integration.conftest import (
    collected,
    deploy_config,
    read_groups,
    run_events,
    small_spec,
    wait_final,
    wait_until,
)

PROMPTS = 4


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory):
    """Two preemptible workers slowed a little, so that a step can be caught in the middle."""
    return deploy_config(
        tmp_path_factory.mktemp("bounded"),
        reserved=0,
        preemptible=2,
        worker_slots=4,
        extra_env={"SPOTRL_STEP_DELAY_MS": "15"},
    )


def spec(model, **over):
    base = {"group_size": 3, "prompts_per_step": PROMPTS, "steps": 4, "max_new_tokens": 16}
    return small_spec(model, ignore_eos=True, **(base | over))


def check_exact(deployment, run_id, body) -> None:
    audit = audit_run(deployment.redis_url, run_id, RunSpec.model_validate(body))
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
    assert audit["max_staleness"] == 0, audit
    groups = read_groups(deployment, run_id)
    assert sorted((g.step, g.prompt_index) for g in groups) == [
        (s, p) for s in range(body["steps"]) for p in range(PROMPTS)
    ]
    for g in groups:
        assert len(g.responses) == body["group_size"]
        assert all(len(r.token_ids) == body["max_new_tokens"] for r in g.responses)


def pending_for_trainer(rdb, run_id) -> int:
    try:
        return rdb.xpending(keys.groups_stream(run_id), keys.TRAINER_GROUP)["pending"]
    except redis.ResponseError:
        return 0


def test_streams_hold_one_step_and_a_trainer_killed_mid_step_resumes_exact(
    deployment, client, rdb, tiny_model
):
    body = spec(tiny_model)
    run_id = client.submit(body)

    def trainer_mid_step_two():
        """Version >= 2 committed, and the trainer holds some, not all, groups of its step."""
        version = int(rdb.get(keys.run_version(run_id)) or 0)
        if version < 2 or version >= body["steps"]:
            return None
        published = rdb.scard(keys.step_published(run_id, version))
        if pending_for_trainer(rdb, run_id) > 0 and published < PROMPTS:
            return version
        return None

    step = wait_until(trainer_mid_step_two, "the trainer was never caught mid-step", 120, 0.005)
    # the groups of the steps already trained are gone from Redis; the step in flight is there
    held = [Group.from_fields(f) for _, f in rdb.xrange(keys.groups_stream(run_id))]
    assert held and {g.step for g in held} == {step}, [(g.step, g.prompt_index) for g in held]
    assert rdb.hlen(keys.run_trained(run_id)) >= step  # the earlier steps' records
    deployment.restart("trainer", kill=True)
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded", run
    check_exact(deployment, run_id, body)
    # nothing of the run's traffic is left in its streams
    assert rdb.xlen(keys.deltas_stream(run_id)) == 0
    assert rdb.xlen(keys.groups_stream(run_id)) == 0
    assert not rdb.exists(keys.jobs_stream(run_id, 0))  # retired once version 1 was committed


def test_redis_near_its_limit_stalls_the_run_with_a_reason(deployment, client, rdb, tiny_model):
    """Over the high mark (85% of maxmemory) before a step: no job is queued and the run says
    why; with room again it goes on and trains every group."""
    # as `spotrl up` and the tests start it: a limit, and never an eviction
    assert rdb.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    assert int(rdb.config_get("maxmemory")["maxmemory"]) == 1024 * 1024 * 1024
    used = rdb.info("memory")["used_memory"]
    rdb.config_set("maxmemory", int(used / 0.9))  # used is 90% of the limit
    try:
        body = spec(tiny_model, steps=2)
        run_id = client.submit(body)
        run = wait_until(
            lambda: (r := client.run(run_id))["state"] == "stalled" and r,
            lambda: f"the run never stalled: {client.run(run_id)}",
        )
        assert "redis memory" in run["stall_reason"] and "85%" in run["stall_reason"], run
        assert not rdb.exists(keys.jobs_stream(run_id, 0))  # nothing issued
    finally:
        rdb.config_set("maxmemory", 1024 * 1024 * 1024)
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded", run
    states = [e["state"] for e in run_events(rdb, run_id, "state")]
    assert states[:3] == ["running", "stalled", "running"], states
    check_exact(deployment, run_id, body)


def test_writes_refused_for_memory_mid_step_lose_nothing(deployment, client, rdb, tiny_model):
    """Redis past maxmemory in the middle of a step refuses every write that needs memory:
    workers hold their tokens and retry, the coordinator retries its batch; nothing dies, and
    once there is room the run finishes with every response exact."""
    body = spec(tiny_model, steps=2)
    run_id = client.submit(body)
    wait_until(lambda: sum(collected(rdb, run_id, 0).values()) >= 6, "no tokens came back")
    coordinator_log = deployment.procs["coordinator"].log_path
    before = coordinator_log.read_text().count("maxmemory")
    rdb.config_set("maxmemory", rdb.info("memory")["used_memory"] // 2)
    try:
        wait_until(
            lambda: coordinator_log.read_text().count("maxmemory") > before,
            "the coordinator never met a refused write",
        )
        deployment.check_alive()
    finally:
        rdb.config_set("maxmemory", 1024 * 1024 * 1024)
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded", run
    check_exact(deployment, run_id, body)
    deployment.check_alive()
    assert all(p.alive() for p in deployment.workers())


def test_workers_gone_long_enough_are_forgotten(redis_url):
    """Churn over days does not pile up in the worker index; a worker back in time stays."""
    import asyncio

    from services.coordinator.workers.fleet import forget_gone_workers
    from services.infra.redis_streams import connect

    async def scenario():
        r = connect(redis_url)
        for w in ("ghost-1", "ghost-2"):
            await r.hset(keys.worker(w), mapping={"id": w, "pool": "preemptible"})
            await r.sadd(keys.WORKER_INDEX, w)
            await r.xadd(keys.worker_control(w), {"m": b"x"})
        assert await forget_gone_workers(r, set(), 1000.0, 10.0) == []  # gone since now
        await r.set(keys.worker_heartbeat("ghost-2"), b"beat")  # ghost-2 is back...
        assert await forget_gone_workers(r, {"ghost-2"}, 1005.0, 10.0) == []
        # ...and its gone_since was cleared: only ghost-1 has been gone for over 10 s
        assert await forget_gone_workers(r, set(), 1011.0, 10.0) == ["ghost-1"]
        assert not await r.sismember(keys.WORKER_INDEX, "ghost-1")
        assert not await r.exists(keys.worker("ghost-1"), keys.worker_control("ghost-1"))
        assert await r.sismember(keys.WORKER_INDEX, "ghost-2")
        await r.delete(keys.worker("ghost-2"), keys.worker_heartbeat("ghost-2"))
        await r.srem(keys.WORKER_INDEX, "ghost-2")
        await r.aclose()

    asyncio.run(scenario())

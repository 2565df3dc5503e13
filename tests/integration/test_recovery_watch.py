"""The recovery watch (services/cli/recovery.py) against a real redis-server and the
coordinator's own writes: the step's durable table staged by `StepStore` and a dead worker's
jobs reclaimed by `step.leadership.reclaim_dead_workers`. It reads which requests the dead
worker held from its pending jobs, ignores its tokens stored late and the stale ones after the
migration, leaves out the request it had finished, and says a request generates again only once
a token of the new lease is stored. Then with real processes: a SIGKILLed worker's requests
migrate no sooner than its heartbeat's TTL less its period allows, a SIGTERMed one's sooner, and
the run stays exact."""

import asyncio
import time

import pytest
import redis

from services.cli.audit import audit_run
from services.cli.recovery import Recovery, RecoveryWatch, busiest_worker, held_requests
from services.contracts import keys
from services.contracts.messages import DeltaItem, Job
from services.contracts.runspec import RunSpec
from services.coordinator.step.leadership import reclaim_dead_workers
from services.coordinator.step.store import StepStore
from services.core.step_controller import StepController
from services.infra.redis_streams import connect
from services.infra.settings import settings_env
from services.rollout.settings import RolloutSettings
from tests import factories
from tests.conftest import apply_all
from tests.integration.conftest import collected, deploy_config, small_spec, wait_final, wait_until
from tests.unit.test_request_table import delta

RUN = "run-recovery"


def read_jobs(r: redis.Redis, worker: str, count: int) -> list[Job]:
    stream = keys.jobs_stream(RUN, 0)
    reply = r.xreadgroup(keys.WORKERS_GROUP, worker, {stream: ">"}, count=count)
    return [Job.from_fields(fields) for _, entries in reply for _, fields in entries]


def test_a_killed_workers_requests_resume_only_with_tokens_of_their_new_lease(empty_redis_url):
    spec = RunSpec(model="m", steps=1, prompts_per_step=2, group_size=2, max_new_tokens=4)
    table = factories.table([[1, 2], [3]], 2, 4, run_id=RUN, seed=7)
    jobs = keys.jobs_stream(RUN, 0)

    async def scenario() -> None:
        ar = connect(empty_redis_url)
        store = StepStore(ar, RUN, 0)

        async def stored(*items: DeltaItem) -> None:
            """A read of the collector: applied to the table, staged in one MULTI."""
            apply_all(table, list(items))  # from the holders of the leases
            async with ar.pipeline(transaction=True) as pipe:
                store.stage_requests(pipe, table, {item.request_id for item in items})
                await pipe.execute()

        with redis.Redis.from_url(empty_redis_url) as r:
            r.hset(keys.run(RUN), "spec", spec.model_dump_json())
            r.xgroup_create(jobs, keys.WORKERS_GROUP, id="0", mkstream=True)
            for rid in table.requests:
                r.xadd(jobs, table.job(rid).fields())
            held_ids = [job.request_id for job in read_jobs(r, "w-dead", 3)]
            other = read_jobs(r, "w-alive", 1)[0].request_id
            r.set(keys.worker_heartbeat("w-alive"), b"1")
            done, going, idle = held_ids
            # the dead worker finished one (not acknowledged: it died first) and began another
            await stored(
                delta(done, 0, [5, 6, 7, 8], finished=True, reason="length"), delta(going, 0, [5])
            )
            at = time.time()  # the SIGKILL
            held = held_requests(r, RUN, "w-dead", [0])
            assert held == dict.fromkeys(held_ids, 0)
            assert held_requests(r, RUN, "w-alive") == {other: 0}
            watch = RecoveryWatch(r, RUN, "w-dead", "kill", held, at)
            assert not watch.poll()
            assert watch.tracker.requests[done].finished
            await stored(delta(going, 1, [6]))  # flushed before its death, stored after
            assert not watch.poll()
            dead = await reclaim_dead_workers(ar, StepController(table), store)
            assert dead == ["w-dead"]
            await stored(delta(going, 2, [9]))  # stale: dropped, never stored
            assert not watch.poll()
            assert watch.tracker.requests[going].prefix_tokens == 2
            assert watch.tracker.requests[idle].prefix_tokens == 0
            continuations = {job.request_id: job for job in read_jobs(r, "w-alive", 10)}
            assert set(continuations) == {going, idle}
            await stored(delta(going, 2, [3], lease=continuations[going].lease))
            assert not watch.poll()
            assert watch.tracker.requests[going].resumed_at is not None
            await stored(delta(idle, 0, [4], lease=continuations[idle].lease))
            assert watch.poll()
            result = watch.wait(1.0)
        await ar.aclose()
        assert (result.held, result.finished_before, result.unresolved) == (2, 1, [])
        assert result.migrated_s is not None and result.recovery_s is not None
        assert 0 < result.migrated_s <= result.recovery_s < 5

    asyncio.run(scenario())


HEARTBEAT_S, HEARTBEAT_TTL_S = 0.3, 1.5


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory):
    """Three preemptible workers with a short heartbeat, for conftest's `deployment`."""
    worker_env = settings_env(
        RolloutSettings,
        heartbeat_s=HEARTBEAT_S,
        heartbeat_ttl_s=HEARTBEAT_TTL_S,
        step_delay_ms=40,
        preempt_grace_s=5,
    )
    return deploy_config(
        tmp_path_factory.mktemp("recovery"),
        reserved=0,
        preemptible=3,
        worker_slots=8,
        worker_env=worker_env,
    )


def lose_busiest(deployment, rdb, spec: dict, run_id: str, step: int, cause: str) -> Recovery:
    """Once a third of the step's tokens are stored, SIGKILL or SIGTERM the worker holding the
    most of its jobs; how its requests recovered."""
    third = spec["prompts_per_step"] * spec["group_size"] * spec["max_new_tokens"] // 3
    wait_until(lambda: sum(collected(rdb, run_id, step).values()) >= third, "tokens", 120)
    victim = wait_until(lambda: busiest_worker(rdb, run_id, step), "a worker holding jobs")
    at = time.time()
    if cause == "kill":
        deployment.procs[victim].kill()
        held = held_requests(rdb, run_id, victim)
    else:
        held = held_requests(rdb, run_id, victim)
        at = time.time()
        deployment.procs[victim].preempt()
    deployment.procs[victim].popen.wait(30)
    return RecoveryWatch(rdb, run_id, victim, cause, held, at).wait(60)


def test_recovery_from_a_real_kill_waits_for_the_heartbeat_and_a_notice_does_not(
    deployment, client, rdb, tiny_model
):
    spec = small_spec(tiny_model, steps=2, max_new_tokens=36, ignore_eos=True)
    run_id = client.submit(spec)
    killed = lose_busiest(deployment, rdb, spec, run_id, 0, "kill")
    wait_until(lambda: rdb.exists(keys.step_meta(run_id, 1)), "step 1 queued", 120)
    noticed = lose_busiest(deployment, rdb, spec, run_id, 1, "notice")
    assert wait_final(client, deployment, run_id)["state"] == "succeeded"
    audit = audit_run(deployment.redis_url, run_id, RunSpec.model_validate(spec))
    assert (audit["lost"], audit["duplicated"]) == (0, 0)
    for loss in (killed, noticed):
        assert loss.held > 0 and loss.unresolved == []
        assert loss.migrated_s is not None and loss.recovery_s is not None
        assert loss.migrated_s < loss.recovery_s
    # the dead worker's heartbeat key outlives it by at least its TTL less its period
    assert killed.migrated_s >= HEARTBEAT_TTL_S - HEARTBEAT_S - 0.01
    assert noticed.migrated_s < killed.migrated_s

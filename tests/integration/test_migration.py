"""Moving requests off dead workers and fencing the ones that come back (the step controller's
decision, carried out by `step.leadership.reclaim_dead_workers` and `step/store.py`) against a real
redis-server: the jobs a worker held when its heartbeat expired are re-queued under new leases
(continuing from the collected tokens, or from zero with migration off), acknowledged and staged
in the step store, once; a delta under an old lease is refused and its worker told to drop the
request."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.messages import DeltaItem, Job, WorkerControl
from services.coordinator.step.deltas import tell
from services.coordinator.step.leadership import reclaim_dead_workers
from services.coordinator.step.store import CLAIMER, StepStore
from services.core.collect import CollectRules
from services.core.request_table import Applied, RequestTable
from services.core.step_controller import Effects, StepController
from services.infra.redis_streams import connect, ensure_group
from tests import factories
from tests.conftest import apply

from .conftest import run_events

RUN, STEP = "run-migrate", 1
STREAM = keys.jobs_stream(RUN, STEP)


def new_table() -> RequestTable:
    """Two prompts of two responses: requests "1:{prompt}:{sample}"."""
    return factories.table([[1, 2], [3, 4]], 2, 6, run_id=RUN, step=STEP, seed=3)


def delta(rid: str, offset: int, tokens: list[int], lease: int) -> DeltaItem:
    return DeltaItem(
        request_id=rid,
        lease=lease,
        grant="",
        offset=offset,
        token_ids=tokens,
        logprobs=[-1.0] * len(tokens),
    )


async def queue_and_read(r, table: RequestTable, readers: dict[str, int]) -> dict[str, list[str]]:
    """Queue the step's jobs (and mark it queued in its step store, in the same MULTI, as the
    coordinator does), then let each reader take its count of them: the requests each holds (a
    worker acknowledges a job only once it finished or released it)."""
    await ensure_group(r, STREAM, keys.WORKERS_GROUP)
    async with r.pipeline(transaction=True) as pipe:
        StepStore(r, RUN, STEP).stage_queued(pipe, table, 1.0)
        for job in table.initial_jobs():
            pipe.xadd(STREAM, job.fields())
        await pipe.execute()
    held = {}
    for name, count in readers.items():
        got = await r.xreadgroup(keys.WORKERS_GROUP, name, {STREAM: ">"}, count=count)
        held[name] = [Job.from_fields(fields).request_id for _, fields in got[0][1]]
    return held


async def alive(r, worker_id: str) -> None:
    await r.set(keys.worker_heartbeat(worker_id), b"beat", ex=30)


async def pending_by_consumer(r) -> dict[str, int]:
    summary = await r.xpending(STREAM, keys.WORKERS_GROUP)
    return {c["name"].decode(): int(c["pending"]) for c in summary["consumers"] or []}


@dataclass
class QueuedStep:
    """Step STEP of RUN, its jobs queued and read (queue_and_read): the client, the coordinator's
    request table and step store, the requests each reader holds, and the stream id of the last
    job queued."""

    r: aioredis.Redis
    table: RequestTable
    store: StepStore
    held: dict[str, list[str]]
    last: bytes

    async def reclaim(self, migration: bool = True) -> list[str]:
        """One pass of the coordinator's reclaim: the dead workers it found."""
        control = StepController(self.table, CollectRules(migration), migration=migration)
        return await reclaim_dead_workers(self.r, control, self.store)

    async def fence(self, stale: dict[str, set[tuple[str, int]]]) -> None:
        """Stale leases fenced, as the effects of a read carry them (written, then told)."""
        effects = Effects(fences=stale)
        await self.store.write(self.table, effects)
        await tell(self.r, self.table, effects)

    async def requeued(self) -> list[Job]:
        """Jobs added to the stream after the step's own."""
        entries = await self.r.xrange(STREAM, min=f"({self.last.decode()}", max="+")
        return [Job.from_fields(fields) for _, fields in entries]


@contextlib.asynccontextmanager
async def queued_step(url: str, readers: dict[str, int]) -> AsyncIterator[QueuedStep]:
    """The step queued and read by `readers` on a client of its own, closed at the end."""
    r = connect(url)
    try:
        table = new_table()
        held = await queue_and_read(r, table, readers)
        last = (await r.xrevrange(STREAM, count=1))[0][0]
        yield QueuedStep(r, table, StepStore(r, RUN, STEP), held, last)
    finally:
        await r.aclose()


def test_a_dead_workers_requests_continue_under_a_new_lease_once(empty_redis_url):
    async def scenario():
        async with queued_step(empty_redis_url, {"w-dead": 2, "w-alive": 2}) as step:
            r, table, held = step.r, step.table, step.held
            await alive(r, "w-alive")  # w-dead has no heartbeat: it died without notice
            rid_a, rid_b = held["w-dead"]
            apply(table, delta(rid_a, 0, [7, 8], lease=0))  # it had flushed two tokens of one

            assert await step.reclaim() == ["w-dead"]
            jobs = {job.request_id: job for job in await step.requeued()}
            assert sorted(jobs) == sorted(held["w-dead"])
            assert (jobs[rid_a].lease, jobs[rid_a].prefix_ids) == (1, [7, 8])
            assert (jobs[rid_a].remaining_tokens, jobs[rid_b].prefix_ids) == (4, [])
            assert table.requests[rid_a].lease == table.requests[rid_b].lease == 1
            for rid in held["w-alive"]:
                assert table.requests[rid].lease == 0  # a live worker keeps its requests
            assert await pending_by_consumer(r) == {"w-alive": 2}  # acknowledged, consumer gone
            consumers = await r.xinfo_consumers(STREAM, keys.WORKERS_GROUP)
            assert "w-dead" not in {c["name"].decode() for c in consumers}

            restored = new_table()  # the new leases are in the step store, with the jobs
            await StepStore(r, RUN, STEP).restore(restored)
            assert restored.requests[rid_a].lease == 1
            assert restored.requests[rid_a].token_ids == [7, 8]

            assert await step.reclaim() == []
            assert len(await step.requeued()) == 2  # migrated once, not at every pass
            assert table.requests[rid_a].lease == 1

    asyncio.run(scenario())


def test_with_migration_off_a_dead_workers_request_starts_over(empty_redis_url):
    async def scenario():
        async with queued_step(empty_redis_url, {"w-dead": 1}) as step:
            (rid,) = step.held["w-dead"]
            apply(step.table, delta(rid, 0, [5, 5, 5], lease=0))
            assert await step.reclaim(migration=False) == ["w-dead"]
            (job,) = await step.requeued()
        assert (job.request_id, job.lease, job.prefix_ids, job.remaining_tokens) == (rid, 1, [], 6)
        assert step.table.requests[rid].token_ids == [] and step.table.tokens_discarded == 3

    asyncio.run(scenario())


def test_a_job_whose_request_moved_on_is_acknowledged_not_migrated_again(empty_redis_url):
    async def scenario():
        async with queued_step(empty_redis_url, {"w-dead": 2}) as step:
            table = step.table
            moved, stays = step.held["w-dead"]
            table.migrate(moved, "preemption")  # released before it died: already on lease 1
            apply(table, delta(stays, 0, [1, 2, 3, 4, 5, 6], lease=0))  # and one it had finished
            assert await step.reclaim() == ["w-dead"]
            assert await step.requeued() == []
            assert table.requests[moved].lease == 1 and table.requests[stays].lease == 0
            assert await pending_by_consumer(step.r) == {}

    asyncio.run(scenario())


def test_jobs_claimed_by_a_coordinator_that_died_are_requeued(empty_redis_url):
    async def scenario():
        # a coordinator claimed these, then died before re-queueing them in its MULTI
        async with queued_step(empty_redis_url, {CLAIMER: 2}) as step:
            assert await step.reclaim() == []
            jobs = await step.requeued()
        assert sorted(j.request_id for j in jobs) == sorted(step.held[CLAIMER])
        assert all(j.lease == 1 for j in jobs)

    asyncio.run(scenario())


def test_a_worker_back_from_the_dead_is_fenced(empty_redis_url):
    async def scenario():
        async with queued_step(empty_redis_url, {"w-dead": 1}) as step:
            r, table = step.r, step.table
            (rid,) = step.held["w-dead"]
            await step.reclaim()
            # it was only slow: it flushes under the lease it had, which moved on
            assert apply(table, delta(rid, 0, [9], lease=0)) is Applied.STALE_LEASE
            assert table.requests[rid].token_ids == []
            await step.fence({"w-dead": {(rid, 0)}})
            entries = await r.xrange(keys.worker_control("w-dead"))
            (order,) = [WorkerControl.from_fields(fields) for _, fields in entries]
            assert (order.action, order.run_id) == ("abort", RUN)
            assert [(q.request_id, q.lease) for q in order.requests] == [(rid, 0)]
            assert apply(table, delta(rid, 0, [4], lease=1)) is Applied.APPENDED  # the new lease

    asyncio.run(scenario())


def test_reclaims_and_fences_are_on_the_runs_timeline(empty_redis_url):
    async def scenario():
        async with queued_step(empty_redis_url, {"w-dead": 2}) as step:
            await step.reclaim()
            await step.fence({"w-dead": {(step.held["w-dead"][0], 0)}})

    asyncio.run(scenario())
    with redis.Redis.from_url(empty_redis_url) as rdb:
        reclaimed = run_events(rdb, RUN, "worker_reclaimed")
        migrated = run_events(rdb, RUN, "migrated")
        fenced = run_events(rdb, RUN, "fenced")
    assert [(e["worker"], e["jobs"], e["step"]) for e in reclaimed] == [("w-dead", 2, STEP)]
    assert [(e["cause"], e["count"]) for e in migrated] == [("death", 2)]
    assert [(e["worker"], e["count"]) for e in fenced] == [("w-dead", 1)]

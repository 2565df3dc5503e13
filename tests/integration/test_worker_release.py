"""A release order for fewer requests than a worker holds gives back exactly those: the others,
generating or read and not started yet, stay with the worker, and every job entry pending under
the worker in Redis is a request it still holds. (A release once emptied the whole inbox while
giving back only `count` of it: the rest stayed pending under a worker that had forgotten them,
and a step's tail waited for them forever.) And a preemption notice gives back every job pending
under the worker, those of a read whose reply never reached it too."""

import asyncio

import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.messages import DeltaBatch, Job, WorkerControl
from services.infra.redis_streams import StreamConsumer, ensure_group, range_entries
from services.rollout.engines.hf import HFEngine
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from tests.factories import job as make_job

RUN, WORKER = "r", "w1"


async def pending_under(r: aioredis.Redis, stream: str) -> set[bytes]:
    entries = await r.xpending_range(stream, keys.WORKERS_GROUP, "-", "+", 100, consumername=WORKER)
    return {e["message_id"] for e in entries}


async def worker_with_jobs(redis_url: str, model: str, queued: int):
    """A worker serving RUN at version 0 (its engine loaded, nothing read yet) and `queued`
    jobs q0, q1, ... on the step's stream; the worker, its lane and a reader of the stream."""
    r = aioredis.from_url(redis_url)
    engine = HFEngine()
    engine.load_weights(model)
    worker = RolloutWorker(RolloutSettings(worker_id=WORKER, redis_url=redis_url), r, engine)
    lane = worker.lanes.open(RUN)
    lane.ctx.version = 0
    stream = keys.jobs_stream(RUN, 0)
    await ensure_group(r, stream, keys.WORKERS_GROUP)
    await r.xadd(keys.deltas_stream(RUN), {"init": "1"})  # the run's deltas stream exists
    for i in range(queued):
        await r.xadd(stream, make_job(f"q{i}", [5, 6, 7], 50).fields())
    jobs = StreamConsumer(r, stream, keys.WORKERS_GROUP, WORKER, Job, replay=False)
    return r, worker, lane, jobs


async def release_some(redis_url: str, model: str) -> None:
    r, worker, lane, jobs = await worker_with_jobs(redis_url, model, 6)
    ctx, stream = lane.ctx, jobs.stream
    read = (await jobs.read(6, 50)).messages
    entry_of = {job.request_id: entry_id for entry_id, job in read}
    for entry_id, job in read[:2]:  # two generate; four wait in the inbox
        ctx.inbox.put(entry_id, job)
    worker.generator._admit(ctx)
    for entry_id, job in read[2:]:
        ctx.inbox.put(entry_id, job)
    assert ctx.engine.active == 2 and len(ctx.inbox) == 4

    worker.control.queue(RUN).put_nowait(WorkerControl(action="release", run_id=RUN, count=1))
    await worker.control.obey_all(ctx, lane.flusher)

    released = [
        lease.request_id
        for _, fields in range_entries(await r.xrange(keys.deltas_stream(RUN)))
        if b"init" not in fields
        for lease in DeltaBatch.from_fields(fields).released
    ]
    assert released == ["q2"]  # one, never started, the first waiting
    assert [job.request_id for job in ctx.inbox.jobs()] == ["q3", "q4", "q5"]
    assert ctx.engine.active == 2 and ctx.busy == 5
    held = {"q0", "q1", "q3", "q4", "q5"}
    assert await pending_under(r, stream) == {entry_of[rid] for rid in held}
    await r.aclose()


def test_a_partial_release_keeps_what_it_does_not_give_back(empty_redis_url, tiny_model):
    asyncio.run(release_some(empty_redis_url, str(tiny_model)))


async def leave_after_a_cut_off_read(redis_url: str, model: str) -> None:
    r, worker, lane, jobs = await worker_with_jobs(redis_url, model, 5)
    ctx, stream = lane.ctx, jobs.stream
    read = (await jobs.read(2, 50)).messages
    for entry_id, job in read:  # two held: one generating, one waiting
        ctx.inbox.put(entry_id, job)
    worker.generator._admit(ctx)
    # the jobs task stopped mid-read: Redis delivered three more, the worker never saw them
    await r.xreadgroup(keys.WORKERS_GROUP, WORKER, {stream: ">"}, count=3)
    assert len(await pending_under(r, stream)) == 5 and ctx.busy == 2

    assert await worker.release_all() == 5

    released = {
        lease.request_id: DeltaBatch.from_fields(fields).release_reason
        for _, fields in range_entries(await r.xrange(keys.deltas_stream(RUN)))
        if b"init" not in fields
        for lease in DeltaBatch.from_fields(fields).released
    }
    assert released == {f"q{i}": "preemption" for i in range(5)}
    assert await pending_under(r, stream) == set()  # nothing left for a heartbeat to reclaim
    assert ctx.busy == 0
    await r.aclose()


def test_a_notice_gives_back_the_jobs_of_a_read_cut_off_too(empty_redis_url, tiny_model):
    asyncio.run(leave_after_a_cut_off_read(empty_redis_url, str(tiny_model)))

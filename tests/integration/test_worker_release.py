"""A release order for fewer requests than a worker holds gives back exactly those: the others,
generating or read and not started yet, stay with the worker, and every job entry pending under
the worker in Redis is a request it still holds. (A release once emptied the whole inbox while
giving back only `count` of it: the rest stayed pending under a worker that had forgotten them,
and a step's tail waited for them forever.)"""

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


async def release_some(redis_url: str, model: str) -> None:
    r = aioredis.from_url(redis_url)
    engine = HFEngine()
    engine.load_weights(model)
    worker = RolloutWorker(RolloutSettings(worker_id=WORKER, redis_url=redis_url), r, engine)
    lane = worker.lanes.open(RUN)
    ctx = lane.ctx
    ctx.version = 0
    stream = keys.jobs_stream(RUN, 0)
    await ensure_group(r, stream, keys.WORKERS_GROUP)
    await r.xadd(keys.deltas_stream(RUN), {"init": "1"})  # the run's deltas stream exists
    for i in range(6):
        await r.xadd(stream, make_job(f"q{i}", [5, 6, 7], 50).fields())
    jobs = StreamConsumer(r, stream, keys.WORKERS_GROUP, WORKER, Job, replay=False)
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

"""Moving requests off workers that are gone, and fencing workers that come back.

- A worker that dies without notice stops renewing its heartbeat key. Every job it still holds
  is in its consumer's pending list (a worker acknowledges a job only when the request finished
  or was released), whether or not it produced a token: the coordinator claims those entries,
  migrates each request under the lease the job carried, and deletes the consumer.
- A delta with an old lease comes from a worker that lost the request (declared dead, then back):
  the worker is told to drop it.
"""

import logging
from typing import cast, get_args

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.typing import StreamIdT

from services.contracts import keys
from services.contracts.consumers import consumer_worker
from services.contracts.messages import (
    Job,
    MalformedMessage,
    ReleaseReason,
    RequestLease,
    WorkerControl,
)
from services.coordinator.step_store import StepStore
from services.coordinator.workers.keys import WorkerKeys
from services.core.reclaim import Reclaim, expired_readers, plan_reclaim
from services.core.request_table import RequestTable
from services.infra.redis_streams import text
from services.state import timeline

log = logging.getLogger(__name__)
MIGRATIONS = Counter("spotrl_coordinator_migrations_total", "Requests migrated", ["cause"])
DEAD = Counter("spotrl_coordinator_workers_declared_dead_total", "Workers whose heartbeat expired")
CLAIMER = "coordinator"
# XCLAIM's reply: (entry id, fields), fields None for an entry deleted while pending
Claimed = list[tuple[bytes, dict[bytes, bytes] | None]]
for _cause in (*get_args(ReleaseReason), "bound"):
    MIGRATIONS.labels(_cause)  # every cause is exported from the start, at 0


async def count_migrations(r: aioredis.Redis, table: RequestTable, cause: str, n: int) -> None:
    if n:
        MIGRATIONS.labels(cause).inc(n)
        await timeline.emit(r, table.run_id, "migrated", cause=cause, count=n, step=table.step)


async def reclaim_dead_workers(
    r: aioredis.Redis,
    stream: str,
    table: RequestTable,
    store: StepStore,
    migration: bool,
    signer: WorkerKeys | None = None,
) -> list[str]:
    """Migrate the requests held by readers of `stream` whose heartbeat expired; their names.

    The claim moves the dead reader's entries to the coordinator's own consumer; what becomes of
    them is decided by `core.reclaim.plan_reclaim` and written, with the acknowledgement of the
    claimed entries, in one MULTI. Entries claimed by a coordinator that died before that MULTI
    are pending under its consumer and are reclaimed the same way on the next pass."""
    dead = []
    for name in await expired_readers_of(r, stream):
        ids, jobs = await claim(r, stream, name)
        plan = plan_reclaim(table, name, jobs, migration, CLAIMER)
        await write_reclaim(r, stream, table, store, ids, plan, signer)
        await count_migrations(r, table, "death", len(plan.moved))
        if not plan.dead:
            log.warning(
                "re-queued %d jobs claimed before a coordinator restart (%d to other shards)",
                len(plan.moved),
                plan.handed_count,
            )
            continue
        DEAD.inc()
        worker = consumer_worker(name)
        dead.append(worker)
        await timeline.emit(
            r, table.run_id, "worker_reclaimed", worker=worker, jobs=len(ids), step=table.step
        )
        log.warning(
            "worker %s missed its heartbeat: migrated %d of its %d jobs (%d by other shards)",
            worker,
            len(plan.moved),
            len(ids),
            plan.handed_count,
        )
    return dead


async def expired_readers_of(r: aioredis.Redis, stream: str) -> list[str]:
    """The readers of `stream` that hold jobs and whose heartbeat key is gone."""
    pending: dict[str, int] = {}
    for consumer in await r.xinfo_consumers(stream, keys.WORKERS_GROUP):
        pending[text(consumer["name"]) or ""] = int(consumer["pending"])
    holding = [name for name, n in pending.items() if n > 0]
    async with r.pipeline(transaction=False) as pipe:
        for name in holding:
            pipe.exists(keys.worker_heartbeat(consumer_worker(name)))
        beating = await pipe.execute()
    alive = {name for name, n in zip(holding, beating, strict=True) if n}
    return expired_readers(pending, alive)


async def claim(r: aioredis.Redis, stream: str, name: str) -> tuple[list[StreamIdT], list[Job]]:
    """Move every entry `name` holds to the coordinator's consumer: their ids, and the jobs
    that can be read (an entry deleted while pending has none)."""
    pending = await r.xpending_range(
        stream, keys.WORKERS_GROUP, min="-", max="+", count=100_000, consumername=name
    )
    ids: list[StreamIdT] = [p["message_id"] for p in pending]
    if not ids:
        return ids, []
    # redis-py types the reply for any connection (text, or ids only with justid); ours answers
    # bytes, and without justid each entry is (id, fields)
    claimed = cast(Claimed, await r.xclaim(stream, keys.WORKERS_GROUP, CLAIMER, 0, ids))
    jobs = []
    for entry_id, fields in claimed:
        if fields is None:
            continue
        try:
            jobs.append(Job.from_fields(fields))
        except MalformedMessage as exc:
            log.warning("unreadable job %s held by %s: %s", entry_id, name, exc)
    return ids, jobs


async def write_reclaim(
    r: aioredis.Redis,
    stream: str,
    table: RequestTable,
    store: StepStore,
    ids: list[StreamIdT],
    plan: Reclaim,
    signer: WorkerKeys | None = None,
) -> None:
    """The reclaim of one reader in one MULTI: the moved requests' new leases, their
    continuation jobs, the releases handed to other shards (signed by `signer` where workers
    sign their deltas), the acknowledgement of the claimed entries and the dead reader's
    consumer deleted."""
    handed = {
        shard: await signer.entry(batch) if signer is not None else batch.fields()
        for shard, batch in plan.handed.items()
    }
    async with r.pipeline(transaction=True) as pipe:
        store.stage_requests(pipe, table, {job.request_id for job in plan.moved})
        for job in plan.moved:
            pipe.xadd(stream, job.fields())
        for shard, fields in handed.items():
            pipe.xadd(keys.deltas_stream(table.run_id, shard), fields)
        if ids:
            pipe.xack(stream, keys.WORKERS_GROUP, *ids)
        if plan.dead:
            pipe.xgroup_delconsumer(stream, keys.WORKERS_GROUP, plan.reader)
        await pipe.execute()


async def fence(r: aioredis.Redis, run_id: str, stale: dict[str, set[tuple[str, int]]]) -> None:
    """Tell each worker to drop the (request, old lease) pairs it sent stale deltas for."""
    for worker_id, pairs in stale.items():
        requests = [RequestLease(request_id=rid, lease=lease) for rid, lease in sorted(pairs)]
        order = WorkerControl(action="abort", run_id=run_id, requests=requests)
        await r.xadd(keys.worker_control(worker_id), order.fields(), maxlen=1000)
        await timeline.emit(r, run_id, "fenced", worker=worker_id, count=len(requests))
        log.info("fenced %d requests on %s", len(requests), worker_id)

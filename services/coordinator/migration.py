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
from services.contracts.messages import (
    DeltaBatch,
    Job,
    MalformedMessage,
    ReleaseReason,
    RequestLease,
    WorkerControl,
)
from services.contracts.shards import shard_of
from services.coordinator.step_store import StepStore
from services.core.collect import keeps_tokens
from services.core.request_table import RequestTable
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
    r: aioredis.Redis, stream: str, table: RequestTable, store: StepStore, migration: bool
) -> list[str]:
    """Migrate the requests held by readers of `stream` whose heartbeat expired; their names.

    The claim moves the dead reader's entries to the coordinator's own consumer; the new leases,
    the continuation jobs and the acknowledgement of the claimed entries then land in one MULTI.
    Entries claimed by a coordinator that died before that MULTI are pending under its consumer,
    which has no heartbeat: the next pass reclaims them the same way. With coordinator shards
    (`contracts.shards`) a request of another shard's table goes, in the same MULTI, to that
    shard's deltas stream as released by the dead worker (cause `death`): the shard migrates it
    as it would the worker's own release."""
    dead, keep = [], keeps_tokens(migration, "death")
    for consumer in await r.xinfo_consumers(stream, keys.WORKERS_GROUP):
        name = consumer["name"]
        name = name.decode() if isinstance(name, bytes) else name
        if consumer["pending"] == 0 or await r.exists(keys.worker_heartbeat(name)):
            continue
        pending = await r.xpending_range(
            stream, keys.WORKERS_GROUP, min="-", max="+", count=100_000, consumername=name
        )
        ids: list[StreamIdT] = [p["message_id"] for p in pending]
        claimed: Claimed = []
        if ids:
            # redis-py types the reply for any connection (text, or ids only with justid); ours
            # answers bytes, and without justid each entry is (id, fields)
            claimed = cast(Claimed, await r.xclaim(stream, keys.WORKERS_GROUP, CLAIMER, 0, ids))
        moved: list[Job] = []
        other_shards: dict[int, list[RequestLease]] = {}  # requests of another shard's table
        for entry_id, fields in claimed:
            if fields is None:
                continue
            try:
                job = Job.from_fields(fields)
            except MalformedMessage as exc:
                log.warning("unreadable job %s held by %s: %s", entry_id, name, exc)
                continue
            if job.request_id not in table.requests and table.shards > 1:
                lease = RequestLease(request_id=job.request_id, lease=job.lease)
                other_shards.setdefault(shard_of(job.request_id, table.shards), []).append(lease)
                continue
            new = table.migrate(job.request_id, "death", keep, lease=job.lease)
            if new is not None:
                moved.append(new)
        async with r.pipeline(transaction=True) as pipe:
            store.stage_requests(pipe, table, {job.request_id for job in moved})
            for job in moved:
                pipe.xadd(stream, job.fields())
            for shard, leases in other_shards.items():
                # the shard that holds them migrates them as the worker's own release would
                released = DeltaBatch(
                    worker_id=name,
                    version=table.version,
                    items=[],
                    released=leases,
                    release_reason="death",
                )
                pipe.xadd(keys.deltas_stream(table.run_id, shard), released.fields())
            if ids:
                pipe.xack(stream, keys.WORKERS_GROUP, *ids)
            if name != CLAIMER:
                pipe.xgroup_delconsumer(stream, keys.WORKERS_GROUP, name)
            await pipe.execute()
        await count_migrations(r, table, "death", len(moved))
        handed = sum(len(leases) for leases in other_shards.values())
        if name == CLAIMER:
            log.warning(
                "re-queued %d jobs claimed before a coordinator restart (%d to other shards)",
                len(moved),
                handed,
            )
            continue
        DEAD.inc()
        dead.append(name)
        await timeline.emit(
            r, table.run_id, "worker_reclaimed", worker=name, jobs=len(ids), step=table.step
        )
        log.warning(
            "worker %s missed its heartbeat: migrated %d of its %d jobs (%d by other shards)",
            name,
            len(moved),
            len(ids),
            handed,
        )
    return dead


async def fence(r: aioredis.Redis, run_id: str, stale: dict[str, set[tuple[str, int]]]) -> None:
    """Tell each worker to drop the (request, old lease) pairs it sent stale deltas for."""
    for worker_id, pairs in stale.items():
        requests = [RequestLease(request_id=rid, lease=lease) for rid, lease in sorted(pairs)]
        order = WorkerControl(action="abort", run_id=run_id, requests=requests)
        await r.xadd(keys.worker_control(worker_id), order.fields(), maxlen=1000)
        await timeline.emit(r, run_id, "fenced", worker=worker_id, count=len(requests))
        log.info("fenced %d requests on %s", len(requests), worker_id)

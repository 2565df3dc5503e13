"""The worker's flush shell: it sends what the `DeltaBuffer` decides (new tokens of every
request, finishes, requests given back) to the run's deltas stream (one flusher per run the
worker serves), then acknowledges the job
entries of the requests that flush finished or released. It also hands requests back: abort
them in the engine and release them in a flush, for the coordinator to migrate.

It decides nothing itself (when a flush is due, what it carries and what stays pending are the
buffer's), and it never reads a stream.

A flush is delivered whole, whoever cancels its caller (a worker told to leave stops its tasks
mid-flush): the send, the buffer's record that it was sent and the acknowledgement run as one
task of their own, and the next flush waits for it. Without that, a flush that reached Redis
but was cut off before it was recorded as sent went again with the next one, its tokens
received twice.
"""

import asyncio
import logging
import time

from prometheus_client import Counter

from services.contracts import keys
from services.contracts.messages import (
    FIELD,
    DeltaBatch,
    ReleaseReason,
    RequestLease,
    StreamFields,
)
from services.core.collect import split_by_shard
from services.core.request_table import step_of
from services.infra.redis_streams import with_reconnect
from services.infra.signing import SIGNATURE_FIELD, sign
from services.rollout.context import WorkerContext
from services.rollout.delta_buffer import Flush

log = logging.getLogger(__name__)
FLUSHES = Counter("spotrl_rollout_flushes_total", "Delta batches sent")


class Flusher:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._order = asyncio.Lock()  # one flush at a time, in the order they are taken
        self._delivery: asyncio.Task[None] | None = None  # the newest flush's delivery

    async def flush(
        self, released: list[RequestLease] | None = None, reason: ReleaseReason = "preemption"
    ) -> None:
        """Send the tokens pending (and `released`, after them); what a failed send carried
        stays pending for the next flush."""
        async with self._order:
            previous = self._delivery
            if previous is not None and not previous.done():
                await asyncio.wait({previous})  # cut off from its caller: it ends first
            ctx = self.ctx
            flush = ctx.buffer.take(time.monotonic(), ctx.version or 0, released, reason)
            if flush is None or ctx.run_id is None:
                return
            delivery = asyncio.create_task(self._deliver(ctx.run_id, flush))
            delivery.add_done_callback(_retrieved)
            self._delivery = delivery
            await asyncio.shield(delivery)

    async def _deliver(self, run_id: str, flush: Flush) -> None:
        """Send a flush, record it as sent, acknowledge the jobs it ended."""
        ctx = self.ctx
        entries = [
            (shard, batch)
            for whole in flush.batches  # one per weight version, the oldest first
            for shard, batch in split_by_shard(whole, ctx.inbox.shards).items()
        ]

        async def send() -> None:
            # NOMKSTREAM: a run that ended took its deltas streams along; a late flush adds
            # nothing. One MULTI: the flush lands whole or not at all, whatever its shards
            async with ctx.r.pipeline(transaction=len(entries) > 1) as pipe:
                for shard, batch in entries:
                    stream = keys.deltas_stream(run_id, shard)
                    pipe.xadd(stream, self._entry(batch), nomkstream=True)
                await pipe.execute()

        await with_reconnect(send, "flush deltas")
        FLUSHES.inc()
        ctx.buffer.sent(flush)
        await self._ack(run_id, flush)

    def _entry(self, batch: DeltaBatch) -> StreamFields:
        """A batch's stream entry: its message, and its signature (field `s`) under this
        worker's key when it has one (`WorkerShared.signing_key`)."""
        message = batch.encode()
        key = self.ctx.w.signing_key
        if key is None:
            return {FIELD: message}
        return {FIELD: message, SIGNATURE_FIELD: sign(key, message)}

    async def _ack(self, run_id: str, flush: Flush) -> None:
        """Acknowledge the job entries of the requests the flush finished or released."""
        if not flush.entry_ids:
            return
        # each on its step's jobs stream (asynchronous RL: a worker holds several steps' jobs)
        by_step: dict[int, list[bytes]] = {}
        for rid, entry_id in zip(flush.entry_requests, flush.entry_ids, strict=True):
            step = step_of(rid)  # an id that names no step: the version's own stream
            by_step.setdefault(step if step >= 0 else self.ctx.version or 0, []).append(entry_id)

        async def ack() -> None:
            async with self.ctx.r.pipeline(transaction=False) as pipe:
                for step, ids in by_step.items():
                    pipe.xack(keys.jobs_stream(run_id, step), keys.WORKERS_GROUP, *ids)
                await pipe.execute()

        await with_reconnect(ack, "ack jobs")

    def held(self) -> list[RequestLease]:
        """Every request this worker holds, those never started first, then by tokens left.
        Only a look: what is not released goes on as before."""
        ctx = self.ctx
        waiting = [
            RequestLease(request_id=job.request_id, lease=job.lease, grant=job.grant)
            for job in ctx.inbox.jobs()
        ]
        running = ctx.buffer.running()
        running.sort(key=lambda lease: ctx.engine.tokens_left(lease.request_id), reverse=True)
        return waiting + running

    async def release(self, leases: list[RequestLease], reason: ReleaseReason) -> int:
        """Flush, then give `leases` back to the coordinator, which migrates them: those
        generating are aborted, those read and never started leave the inbox (their job
        entries are acknowledged with the flush)."""
        ctx = self.ctx
        for entry_id, job in ctx.inbox.take({req.request_id for req in leases}):
            ctx.buffer.hold(job.request_id, entry_id)
        for req in leases:
            ctx.engine.abort(req.request_id)
        ctx.slot_freed.set()
        await self.flush(released=leases, reason=reason)
        if leases:
            log.info("released %d requests (%s)", len(leases), reason)
        return len(leases)


def _retrieved(task: asyncio.Task[None]) -> None:
    """A delivery whose caller was cancelled has nobody awaiting it: its error is logged here."""
    if not task.cancelled() and task.exception() is not None:
        log.error("a flush cut off from its caller failed: %s", task.exception())

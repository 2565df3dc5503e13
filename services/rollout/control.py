"""The coordinator's orders to one worker, from its control stream: abort requests whose lease
moved on (fencing), release some requests (load balancing), pause for the rest of a version
(a reserved worker stepping aside for training: it gives back everything), or serve another
active run (the fleet's placement: the jobs task follows `placed_run`).

The jobs tasks read the orders (`read`), each order queued for the part of the worker that
serves its run; the generation task carries them out (`obey_all`, run by run) between decode
steps, so an order never lands in the middle of one. Orders to an earlier incarnation of this
worker, or about a run it does not serve, are skipped. It decides no order itself.
"""

import asyncio
import logging

from services.contracts import keys
from services.contracts.messages import RequestLease, WorkerControl
from services.infra.redis_streams import (
    decode_or_park,
    range_entries,
    read_entries,
    with_reconnect,
)
from services.rollout.context import WorkerContext, WorkerShared
from services.rollout.flusher import Flusher

log = logging.getLogger(__name__)
READ_COUNT = 100  # orders read at once


class Control:
    def __init__(self, w: WorkerShared) -> None:
        self.w = w
        self.stream = keys.worker_control(w.s.worker_id)
        self.last_id = b"0-0"
        self.orders: dict[str, asyncio.Queue[WorkerControl]] = {}  # by run
        self._reading = asyncio.Lock()  # the lanes' jobs tasks read in turn

    async def skip_earlier(self) -> None:
        """Read only orders sent from now on: those before were to an earlier incarnation."""
        last = range_entries(await self.w.r.xrevrange(self.stream, count=1))
        self.last_id = last[0][0] if last else b"0-0"

    async def read(self) -> None:
        """Queue the new orders about the runs served now (for the generation task)."""
        async with self._reading:
            reply = await with_reconnect(
                lambda: self.w.r.xread({self.stream: self.last_id}, count=READ_COUNT),
                "read control",
            )
            for entry in read_entries(reply):
                self.last_id = entry[0]
                order = decode_or_park(WorkerControl, entry, [])
                if order is not None and order.action == "serve":
                    self.w.placed_run = order.run_id  # the lanes follow it
                elif order is not None and order.run_id in self.w.lanes:
                    self.queue(order.run_id).put_nowait(order)

    def queue(self, run_id: str) -> asyncio.Queue[WorkerControl]:
        return self.orders.setdefault(run_id, asyncio.Queue())

    def forget(self, run_id: str) -> None:
        """The worker no longer serves `run_id`: orders about it left unobeyed go."""
        self.orders.pop(run_id, None)

    async def obey_all(self, ctx: WorkerContext, flusher: Flusher) -> None:
        """Carry out the orders queued about `ctx`'s run."""
        orders = self.queue(ctx.run_id)
        while not orders.empty():
            await self._obey(ctx, flusher, orders.get_nowait())

    async def _obey(self, ctx: WorkerContext, flusher: Flusher, order: WorkerControl) -> None:
        if order.action == "abort":
            for req in order.requests:
                self._abort(ctx, req)
        elif order.action == "release":
            await flusher.release(flusher.held()[: order.count], "balance")
        elif order.action == "pause" and order.version == ctx.version:
            ctx.paused_version = order.version
            await flusher.release(flusher.held(), "seed")
            async with ctx.engine_lock:
                await ctx.engine.pause()  # free the accelerator for training
        elif order.action == "resume" and order.version == ctx.paused_version:
            # a paused engine may have dropped its weights (vLLM's sleep): load them again
            ctx.paused_version, ctx.version = None, None

    def _abort(self, ctx: WorkerContext, req: RequestLease) -> None:
        """Drop a request whose lease moved on (fencing); its job entry is no longer ours."""
        if not ctx.buffer.forget(req):
            return
        ctx.engine.abort(req.request_id)
        ctx.slot_freed.set()
        log.info("dropped %s (lease %d): it was migrated", req.request_id, req.lease)

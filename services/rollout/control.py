"""The coordinator's orders to one worker, from its control stream: abort requests whose lease
moved on (fencing), release some requests (load balancing), pause for the rest of a version
(a reserved worker stepping aside for training: it gives back everything), or serve another
active run (the fleet's placement: the jobs task follows `placed_run`).

The jobs task reads the orders (`read`); the generation task carries them out (`obey_all`)
between decode steps, so an order never lands in the middle of one. Orders to an earlier
incarnation of this worker, or about another run, are skipped. It decides no order itself.
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
from services.rollout.context import WorkerContext
from services.rollout.flusher import Flusher

log = logging.getLogger(__name__)
READ_COUNT = 100  # orders read at once


class Control:
    def __init__(self, ctx: WorkerContext, flusher: Flusher) -> None:
        self.ctx = ctx
        self.flusher = flusher
        self.stream = keys.worker_control(ctx.s.worker_id)
        self.last_id = b"0-0"
        self.orders: asyncio.Queue[WorkerControl] = asyncio.Queue()

    async def skip_earlier(self) -> None:
        """Read only orders sent from now on: those before were to an earlier incarnation."""
        last = range_entries(await self.ctx.r.xrevrange(self.stream, count=1))
        self.last_id = last[0][0] if last else b"0-0"

    async def read(self) -> None:
        """Queue the new orders about the run served now (for the generation task)."""
        reply = await with_reconnect(
            lambda: self.ctx.r.xread({self.stream: self.last_id}, count=READ_COUNT),
            "read control",
        )
        for entry in read_entries(reply):
            self.last_id = entry[0]
            order = decode_or_park(WorkerControl, entry, [])
            if order is not None and order.action == "serve":
                self.ctx.placed_run = order.run_id  # the jobs task follows it
            elif order is not None and order.run_id == self.ctx.run_id:
                self.orders.put_nowait(order)

    async def obey_all(self) -> None:
        while not self.orders.empty():
            await self._obey(self.orders.get_nowait())

    async def _obey(self, order: WorkerControl) -> None:
        ctx = self.ctx
        if order.action == "abort":
            for req in order.requests:
                self._abort(req)
        elif order.action == "release":
            await self.flusher.release(self.flusher.held()[: order.count], "balance")
        elif order.action == "pause" and order.version == ctx.version:
            ctx.paused_version = order.version
            await self.flusher.release(self.flusher.held(), "seed")
            async with ctx.engine_lock:
                await ctx.engine.pause()  # free the accelerator for training
        elif order.action == "resume" and order.version == ctx.paused_version:
            # a paused engine may have dropped its weights (vLLM's sleep): load them again
            ctx.paused_version, ctx.version = None, None

    def _abort(self, req: RequestLease) -> None:
        """Drop a request whose lease moved on (fencing); its job entry is no longer ours."""
        if not self.ctx.buffer.forget(req):
            return
        self.ctx.engine.abort(req.request_id)
        self.ctx.slot_freed.set()
        log.info("dropped %s (lease %d): it was migrated", req.request_id, req.lease)

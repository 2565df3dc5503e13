"""The generation task: between decode steps it carries out the coordinator's orders and starts
the jobs read; then it runs one engine step, keeps the tokens in the `DeltaBuffer` and flushes
when the buffer says a flush is due.

A job marked `isolate` (it was running when a worker crashed) runs with nothing beside it. In a
run with drafts on, a response that finishes here becomes a draft of its siblings running here
(`sibling_drafts`). The task does not read streams or load weights (the jobs task does) and
decides no flush itself.
"""

import asyncio
import re
import time

from prometheus_client import Counter, Gauge

from services.rollout.context import WorkerContext
from services.rollout.control import Control
from services.rollout.engines.base import TokenEvent
from services.rollout.flusher import Flusher
from services.rollout.sibling_drafts import SiblingDrafts

IDLE_S = 0.005  # an idle engine looks for work this often
TOKENS = Counter("spotrl_rollout_tokens_total", "Tokens generated", ["worker", "pool"])
ACTIVE = Gauge("spotrl_rollout_active_requests", "Requests generating")


class Generator:
    def __init__(self, ctx: WorkerContext, control: Control, flusher: Flusher) -> None:
        self.ctx = ctx
        self.control = control
        self.flusher = flusher
        pattern = ctx.s.fault_crash_requests
        self.fault = re.compile(pattern) if pattern else None
        # an engine that drafts: its requests draft from siblings that finish here too
        set_drafts = getattr(ctx.engine, "set_drafts", None)
        self.siblings = SiblingDrafts(set_drafts) if set_drafts is not None else None

    async def run_forever(self) -> None:
        while True:
            await self.control.obey_all()
            self._admit()
            ACTIVE.set(self.ctx.engine.active)
            if self.ctx.engine.active == 0:
                await self.flusher.flush()
                await asyncio.sleep(IDLE_S)
                continue
            await self._step()
            if self.ctx.buffer.flush_due(time.monotonic()):
                await self.flusher.flush()

    async def _step(self) -> None:
        """One decode step of every running request, its tokens kept for the next flush."""
        ctx = self.ctx
        batch, started = ctx.engine.active, time.perf_counter()
        async with ctx.engine_lock:
            self._inject_fault()
            events = await ctx.engine.step()
        delay_ms = ctx.s.step_delay_ms + ctx.s.step_delay_per_request_ms * batch
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000)
        ctx.plateau.record(batch, len(events), time.perf_counter() - started)
        self._record(events)

    def _admit(self) -> None:
        """Start the jobs read, in order. A job marked `isolate` runs with nothing beside it:
        it waits for the engine to empty, and nothing starts while it runs. A job the engine
        has no memory for yet waits for running ones to finish."""
        ctx = self.ctx
        waiting = []
        for entry_id, job in ctx.inbox.take_all():
            # a job of an earlier step than the version held is no longer ours; one of a later
            # step in flight (asynchronous RL: the intake reads only those within the bound) is
            if job.run_id != ctx.run_id or ctx.version is None or job.step < ctx.version:
                continue
            if ctx.buffer.isolated_running or (job.isolate and ctx.engine.active):
                waiting.append((entry_id, job))
                continue
            if not ctx.engine.fits(job):  # no room in the engine's memory yet
                waiting.append((entry_id, job))
                continue
            ctx.engine.add(job)  # under the newest adapter the engine holds, in a LoRA run
            ctx.buffer.start(job, entry_id, ctx.version)
            if self.siblings is not None and ctx.share_drafts:
                self.siblings.started(job, self._holds)
        ctx.inbox.put_back(waiting)

    def _holds(self, request_id: str, lease: int) -> bool:
        """Whether `request_id` still generates here under `lease` (not finished, aborted or
        released)."""
        p = self.ctx.buffer.pending.get(request_id)
        return p is not None and p.lease == lease and p.running

    def _inject_fault(self) -> None:
        """Fault injection for tests (`fault_crash_requests`): a decode step that holds a
        matching request dies of a RuntimeError, as an engine bug would."""
        if self.fault is None:
            return
        for req in self.ctx.buffer.running():
            if self.fault.fullmatch(req.request_id):
                raise RuntimeError(f"fault injection: request {req.request_id} crashes this worker")

    def _record(self, events: list[TokenEvent]) -> None:
        ctx = self.ctx
        if ctx.buffer.record_step(events):
            ctx.slot_freed.set()
        if self.siblings is not None and ctx.share_drafts:
            self.siblings.record(events, self._holds)
        ctx.tokens_generated += len(events)
        TOKENS.labels(ctx.s.worker_id, ctx.s.pool).inc(len(events))

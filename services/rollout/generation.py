"""The generation task: between decode steps it carries out the coordinator's orders and starts
the jobs read, of every run the worker serves; then it runs one step of the shared engine, for
all of them at once, keeps each run's tokens in its `DeltaBuffer` and flushes a run's when its
buffer says a flush is due.

A job marked `isolate` (it was running when a worker crashed) runs with nothing beside it. In a
run with drafts on, a response that finishes here becomes a draft of its siblings running here
(`sibling_drafts`). The task does not read streams or load weights (the jobs task does) and
decides no flush itself.
"""

import asyncio
import functools
import re
import time

from prometheus_client import Counter, Gauge

from services.rollout.context import WorkerContext, WorkerShared
from services.rollout.control import Control
from services.rollout.engines.base import TokenEvent
from services.rollout.flusher import Flusher
from services.rollout.sibling_drafts import SiblingDrafts

IDLE_S = 0.005  # an idle engine looks for work this often
TOKENS = Counter("spotrl_rollout_tokens_total", "Tokens generated", ["worker", "pool"])
ACTIVE = Gauge("spotrl_rollout_active_requests", "Requests generating")


class Generator:
    def __init__(self, w: WorkerShared, control: Control) -> None:
        self.w = w
        self.control = control
        self.flushers: dict[str, Flusher] = {}  # each run's (`lanes` adds and removes them)
        pattern = w.s.fault_crash_requests
        self.fault = re.compile(pattern) if pattern else None
        self.siblings: dict[str, SiblingDrafts] = {}  # each run's, where the engine drafts

    def serve(self, ctx: WorkerContext, flusher: Flusher) -> None:
        """Generate for `ctx`'s run from now on (its jobs task started)."""
        self.flushers[ctx.run_id] = flusher
        if ctx.engine.drafts:  # an engine that drafts: requests draft from siblings too
            self.siblings[ctx.run_id] = SiblingDrafts(ctx.engine.set_drafts)

    def stop(self, run_id: str) -> None:
        self.flushers.pop(run_id, None)
        self.siblings.pop(run_id, None)

    async def run_forever(self) -> None:
        while True:
            await self.round()

    async def round(self) -> None:
        """Orders, admissions and one decode step of every run served; flushes due."""
        lanes = [(self.w.lanes[run], f) for run, f in self.flushers.items() if run in self.w.lanes]
        for ctx, flusher in lanes:
            await self.control.obey_all(ctx, flusher)
            async with self.w.engine_lock:  # never into an engine another lane is loading
                self._admit(ctx)
        ACTIVE.set(self.w.engine.active)
        if self.w.engine.active == 0:
            for _, flusher in lanes:
                await flusher.flush()
            await asyncio.sleep(IDLE_S)
            return
        await self._step()
        now = time.monotonic()
        for ctx, flusher in lanes:
            if ctx.buffer.flush_due(now):
                await flusher.flush()

    async def _step(self) -> None:
        """One decode step of every running request, its tokens kept for the next flush."""
        w = self.w
        batch, started = w.engine.active, time.perf_counter()
        async with w.engine_lock:
            self._inject_fault()
            events = await w.engine.step()
        delay_ms = w.s.step_delay_ms + w.s.step_delay_per_request_ms * batch
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000)
        w.plateau.record(batch, sum(len(e) for e in events.values()), time.perf_counter() - started)
        for run_id, run_events in events.items():
            ctx = w.lanes.get(run_id)
            if ctx is not None:
                self._record(ctx, run_events)

    def _admit(self, ctx: WorkerContext) -> None:
        """Start the run's jobs read, in order (under `engine_lock`: a load awaits midway, and
        a vLLM engine restarting with LoRA holds no engine then). A job marked `isolate` runs
        with nothing beside it: it waits for the engine to empty, and nothing starts while it
        runs. A job the engine has no memory for yet waits for running ones to finish."""
        waiting = []
        siblings = self.siblings.get(ctx.run_id) if ctx.share_drafts else None
        isolated = any(c.buffer.isolated_running for c in self.w.lanes.values())
        for entry_id, job in ctx.inbox.take_all():
            # a job of an earlier step than the version held is no longer ours; one of a later
            # step in flight (asynchronous RL: the intake reads only those within the bound) is
            if job.run_id != ctx.run_id or ctx.version is None or job.step < ctx.version:
                continue
            if isolated or (job.isolate and self.w.engine.active):
                waiting.append((entry_id, job))
                continue
            if not ctx.engine.fits(job):  # no room in the engine's memory yet
                waiting.append((entry_id, job))
                continue
            ctx.engine.add(job)  # under the run's newest adapter the engine holds, in LoRA
            ctx.buffer.start(job, entry_id, ctx.version)
            if siblings is not None:
                siblings.started(job, functools.partial(_holds, ctx))
        ctx.inbox.put_back(waiting)

    def _inject_fault(self) -> None:
        """Fault injection for tests (`fault_crash_requests`): a decode step that holds a
        matching request dies of a RuntimeError, as an engine bug would."""
        if self.fault is None:
            return
        for ctx in self.w.lanes.values():
            for req in ctx.buffer.running():
                if self.fault.fullmatch(req.request_id):
                    raise RuntimeError(
                        f"fault injection: request {req.request_id} crashes this worker"
                    )

    def _record(self, ctx: WorkerContext, events: list[TokenEvent]) -> None:
        w = self.w
        if ctx.buffer.record_step(events):
            w.slot_freed.set()
        siblings = self.siblings.get(ctx.run_id) if ctx.share_drafts else None
        if siblings is not None:
            siblings.record(events, functools.partial(_holds, ctx))
        w.tokens_generated += len(events)
        TOKENS.labels(w.s.worker_id, w.s.pool).inc(len(events))


def _holds(ctx: WorkerContext, request_id: str, lease: int) -> bool:
    """Whether `request_id` still generates in `ctx`'s run here under `lease` (not finished,
    aborted or released)."""
    p = ctx.buffer.pending.get(request_id)
    return p is not None and p.lease == lease and p.running

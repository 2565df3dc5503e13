"""Which runs a worker serves, and the part of the worker each gets (a lane): the jobs task.

The runs (`runs_to_serve`, the one decision here): the run the fleet's placement ordered the
worker to serve, else the oldest active one. With `runs_at_once` > 1 and an engine that
applies adapters itself, also the other active LoRA runs on that run's base model
(`keys.run_base`), oldest first, up to that many: one engine generates for all of them in one
batch, each request under its run's adapter (issue 52).

A lane is a run's own part of the worker: its context (its view of the engine, version, inbox,
tokens), flusher, weight loader and jobs task (`intake.JobIntake`). A run the worker stops
serving while it is still active gets back what the worker holds of it first (release cause
`balance`), so those requests go on elsewhere from their tokens; what it holds of a run that
ended is dropped. Then the run's view of the engine goes (its weight folders stay, as they
did for a worker that moved between runs: a later load's clean-up removes the base).
"""

import asyncio
import logging
from dataclasses import dataclass
from typing import cast

from services.contracts import keys
from services.infra.cancel import cancel_and_wait
from services.infra.redis_streams import text, with_reconnect
from services.rollout.context import WorkerContext, WorkerShared
from services.rollout.control import Control
from services.rollout.flusher import Flusher
from services.rollout.generation import Generator
from services.rollout.intake import JobIntake
from services.rollout.peers import Peers
from services.rollout.weight_loader import VersionLoader
from services.state.run_state import active_runs

log = logging.getLogger(__name__)
IDLE_S = 0.1  # between looks at the active runs
STOP_WAIT_S = 0.5  # a lane's jobs task stopping (a preemption notice's grace is counted)


def runs_to_serve(
    active: list[str], placed: str | None, bases: dict[str, str | None], most: int
) -> list[str]:
    """The runs a worker serves, the first the one it was placed on (else the oldest active);
    `bases`: each LoRA run's base model (a run missing or None trains every weight)."""
    first = placed if placed in active else (active[0] if active else None)
    if first is None:
        return []
    base = bases.get(first)
    if most <= 1 or base is None:
        return [first]
    beside = [run for run in active if run != first and bases.get(run) == base]
    return [first, *beside[: most - 1]]


@dataclass
class Lane:
    ctx: WorkerContext
    flusher: Flusher
    loader: VersionLoader
    intake: JobIntake
    task: asyncio.Task[None] | None = None


class Lanes:
    def __init__(
        self, w: WorkerShared, control: Control, generator: Generator, peers: Peers | None
    ) -> None:
        self.w, self.control, self.generator, self.peers = w, control, generator, peers
        self.lanes: dict[str, Lane] = {}
        self.bases: dict[str, str | None] = {}  # each active run's base (None: full weights)

    async def run_forever(self) -> None:
        """After the worker registered (`RolloutWorker.jobs_forever`); a lane's jobs task
        that dies takes this one with it (its error goes on)."""
        await self.control.skip_earlier()
        try:
            while True:
                await self._round()
        finally:
            tasks = [lane.task for lane in self.lanes.values() if lane.task is not None]
            await cancel_and_wait(tasks, STOP_WAIT_S)

    async def _round(self) -> None:
        w = self.w
        if w.crashed:  # take no more work: the service is going down
            w.state = "crashed"
            await asyncio.sleep(IDLE_S)
            return
        await self.control.read()
        runs = await with_reconnect(lambda: active_runs(w.r), "active runs")
        bases = await self._bases(runs)
        wanted = runs_to_serve(runs, w.placed_run, bases, w.s.runs_at_once)
        for run_id in [run for run in self.lanes if run not in wanted]:
            await self.close(run_id, still_active=run_id in runs)
        for run_id in wanted:
            lane = self.lanes.get(run_id) or self.open(run_id)
            if lane.task is None or lane.task.done():  # new, or after a restart of this task
                lane.task = asyncio.create_task(lane.intake.run_forever(), name=f"jobs {run_id}")
        if not self.lanes:
            w.state = "idle"
        await self._watch()

    async def _bases(self, runs: list[str]) -> dict[str, str | None]:
        """Each active run's base where the worker may serve several at once; else none. A
        run's base is written with the run and never changes: read once per run."""
        if self.w.s.runs_at_once <= 1 or not self.w.engine.engine.max_adapters or len(runs) < 2:
            return {}
        unknown = [run for run in runs if run not in self.bases]
        if unknown:
            raw = await with_reconnect(
                lambda: self.w.r.mget([keys.run_base(run) for run in unknown]), "run bases"
            )
            got = (text(b) for b in cast(list[bytes | None], raw))
            self.bases.update(zip(unknown, got, strict=True))
        self.bases = {run: self.bases[run] for run in runs}  # ended runs go
        return dict(self.bases)

    async def _watch(self) -> None:
        """Wait `IDLE_S`, or less where a lane's jobs task ends: its error goes on."""
        tasks = {lane.task for lane in self.lanes.values() if lane.task is not None}
        if not tasks:
            await asyncio.sleep(IDLE_S)
            return
        done, _ = await asyncio.wait(tasks, timeout=IDLE_S, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise cast(BaseException, task.exception())

    def open(self, run_id: str) -> Lane:
        """Serve `run_id` from now on (its jobs task not started yet)."""
        ctx = self.w.lane(run_id)
        flusher = Flusher(ctx)
        loader = VersionLoader(ctx, flusher.held, flusher.release, self.peers)
        intake = JobIntake(ctx, self.control, loader, flusher)
        lane = self.lanes[run_id] = Lane(ctx, flusher, loader, intake)
        self.generator.serve(ctx, flusher)
        log.info("serving run %s (%d runs at once)", run_id, len(self.lanes))
        return lane

    async def close(self, run_id: str, still_active: bool) -> None:
        """Stop serving `run_id`: what the worker holds of it goes back to the run where it is
        still active, and is dropped where it ended."""
        lane = self.lanes.pop(run_id)
        if lane.task is not None:
            await cancel_and_wait([lane.task], STOP_WAIT_S)
        w, ctx = self.w, lane.ctx
        async with w.engine_lock:
            if still_active:
                given = await lane.flusher.release(lane.flusher.held(), "balance")
                log.info("no longer serving run %s: gave back %d requests", run_id, given)
            dropped = ctx.drop_held()
        if dropped:
            log.info("run %s ended: dropped %d requests", run_id, dropped)
        self.generator.stop(run_id)
        self.control.forget(run_id)
        w.lanes.pop(run_id, None)
        w.engine.close_view(run_id)

    async def release_all(self) -> int:
        """Give back every request held, of every run (a preemption notice), then the jobs
        still pending under the worker's name: a read cut off as its jobs task stopped
        delivered them in Redis and never here. Left pending, they would wait for the
        heartbeat to lapse and come back as a death."""
        given = 0
        for lane in list(self.lanes.values()):
            given += await lane.flusher.release(lane.flusher.held(), "preemption")
            if unread := await lane.intake.adopt_pending():
                log.info("run %s: %d jobs read as it stopped", lane.ctx.run_id, len(unread))
                given += await lane.flusher.release(unread, "preemption")
        return given

    def parts(self) -> list[tuple[WorkerContext, Flusher]]:
        return [(lane.ctx, lane.flusher) for lane in self.lanes.values()]

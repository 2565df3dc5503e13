"""The jobs task: after registering, it follows the active run and its committed version
(loading each new version), reads the coordinator's orders, and reads token-level jobs of
exactly the version loaded, as many as there are free slots (up to its plateau and the step's
read cap), into the worker's inbox.

A worker that stepped aside (paused) reads no job of that version; one that crashed reads
nothing more. The task does not start jobs or touch the engine outside `engine_lock` (the
generation task drives it), and it decides no placement (the coordinator does).
"""

import asyncio
import contextlib
import logging

from services.common import keys
from services.common.messages import Job
from services.common.redis_streams import StreamConsumer, with_reconnect
from services.common.run_state import active_run, committed_version, wait_for_version
from services.rollout.context import WorkerContext
from services.rollout.control import Control
from services.rollout.presence import register
from services.rollout.weight_loader import VersionLoader

log = logging.getLogger(__name__)
FULL_WAIT_S = 0.05  # a worker with every slot busy re-checks for a new version this often
IDLE_S = 0.1  # no run, or crashed: look again after this long
VERSION_WAIT_S = 0.05  # no version yet, or paused: look again after this long
READ_BLOCK_MS = 50


class JobIntake:
    def __init__(self, ctx: WorkerContext, control: Control, loader: VersionLoader) -> None:
        self.ctx = ctx
        self.control = control
        self.loader = loader
        self.jobs: StreamConsumer[Job] | None = None  # of the version loaded
        # the last read found no job and the worker holds none: the next round waits for a
        # new version (woken by its announcement) and then reads without waiting
        self.idle = False

    async def run_forever(self) -> None:
        await register(self.ctx.s)
        await self.control.skip_earlier()
        while True:
            await self._round()

    async def _round(self) -> None:
        """Look at the run, its version and this worker's room once, and read what fits."""
        ctx = self.ctx
        if ctx.crashed:  # take no more work: the service is going down
            ctx.state = "crashed"
            await asyncio.sleep(IDLE_S)
            return
        await self.control.read()
        run_id = await with_reconnect(lambda: active_run(ctx.r), "active run")
        if run_id != ctx.run_id:
            await self._switch_run(run_id)
        if run_id is None:
            ctx.state = "idle"
            await asyncio.sleep(IDLE_S)
            return
        # through an outage: a round that raised would register the worker again, which the
        # coordinator refuses while its Redis is away too
        if self.idle:
            latest = await with_reconnect(
                lambda: wait_for_version(ctx.r, run_id, ctx.version, READ_BLOCK_MS), "version"
            )
        else:
            latest = await with_reconnect(lambda: committed_version(ctx.r, run_id), "version")
        if latest is None:
            await asyncio.sleep(VERSION_WAIT_S)
        elif latest != ctx.version:
            self.idle = False
            await self.loader.load(run_id, latest)
            if ctx.version == latest and not ctx.crashed:
                # its jobs are queued already: read them now, after the orders (a pause may
                # have come meanwhile), without looking at the run and its version again
                await self.control.read()
                if not ctx.paused:
                    await self._read_jobs(run_id, latest)
        elif ctx.paused:  # stepped aside until the next version
            ctx.state = "paused"
            await asyncio.sleep(VERSION_WAIT_S)
        else:
            await self._read_jobs(run_id, latest)

    async def _switch_run(self, run_id: str | None) -> None:
        ctx = self.ctx
        async with ctx.engine_lock:
            dropped = ctx.drop_held()
        if dropped:
            log.info("run changed: dropped %d requests", dropped)
        ctx.run_id, ctx.version, ctx.paused_version = run_id, None, None

    async def _read_jobs(self, run_id: str, version: int) -> None:
        """Read as many jobs as there are free slots, up to the plateau and to the step's read
        cap (an equal share: the coordinator keeps it current); park and acknowledge malformed
        ones."""
        ctx = self.ctx
        cap = await self._read_cap(run_id, version)
        free = min(ctx.s.slots, ctx.plateau.plateau(), ctx.s.slots if cap is None else cap)
        free -= ctx.busy
        if cap is None:
            # no cap yet: the step may not be queued, and a blocked read of many would take
            # them all the moment it is (the cap comes in the same MULTI); read one at a time
            # until there is one (with fair reads off there never is)
            free = min(free, 1)
        if free <= 0:
            await self._wait_for_slot()
            return
        ctx.state = "serving"
        jobs = self._consumer(keys.jobs_stream(run_id, version))
        read = await jobs.read(free, None if self.idle else READ_BLOCK_MS)
        self.idle = not read.messages and ctx.busy == 0
        for entry_id, job in read.messages:
            ctx.inbox.put(entry_id, job)
        await jobs.park(read, keys.parked_stream(run_id), "jobs")
        if read.parked:
            await ctx.r.xack(jobs.stream, keys.WORKERS_GROUP, *[p[0] for p in read.parked])

    async def _read_cap(self, run_id: str, version: int) -> int | None:
        """The step's read cap; None where the coordinator set none (fair reads off, or the
        step not queued yet)."""
        raw = await self.ctx.r.get(keys.read_cap(run_id, version))
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return None

    async def _wait_for_slot(self) -> None:
        """Full: wait for a request to end (or a while, to notice a new version), not poll
        Redis in a tight loop beside the engine."""
        self.ctx.slot_freed.clear()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that
        # lands as its wait ends, and a killed worker would run on
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FULL_WAIT_S):
                await self.ctx.slot_freed.wait()

    def _consumer(self, stream: str) -> StreamConsumer[Job]:
        if self.jobs is None or self.jobs.stream != stream:
            self.jobs = StreamConsumer(
                self.ctx.r, stream, keys.WORKERS_GROUP, self.ctx.s.worker_id, Job, replay=False
            )
        return self.jobs

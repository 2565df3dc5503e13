"""A run's jobs task, one per run the worker serves (`lanes` starts and stops them): it
follows the run's committed version (loading each new version), reads the coordinator's
orders, and reads token-level jobs of exactly the version loaded, as many as there are free
slots (the worker's, shared by the runs it serves, up to its plateau, and the step's read cap
for this worker), into the run's inbox.

A run stepped aside from (paused) reads no job of that version; a worker that crashed reads
nothing more. The task does not start jobs or touch the engine outside `engine_lock` (the
generation task drives it), and it decides no placement (the coordinator does) nor which runs
the worker serves (`lanes` does).
"""

import asyncio
import contextlib
import logging
import time

from services.contracts import keys
from services.contracts.messages import FleetAllotment, Job, MalformedMessage, RequestLease
from services.core.fleet_shares import worker_part
from services.infra.redis_streams import (
    StreamConsumer,
    decode_or_park,
    read_group,
    with_reconnect,
)
from services.rollout.context import WorkerContext
from services.rollout.control import Control
from services.rollout.flusher import Flusher
from services.rollout.weight_loader import VersionLoader
from services.state.run_state import committed_version, wait_for_version

log = logging.getLogger(__name__)
FULL_WAIT_S = 0.05  # a worker with every slot busy re-checks for a new version this often
IDLE_S = 0.1  # no run, or crashed: look again after this long
VERSION_WAIT_S = 0.05  # no version yet, or paused: look again after this long
READ_BLOCK_MS = 50
ALLOT_FRESH_S = 0.1  # the lanes of a worker share one read of the fleet's allotment this long


class JobIntake:
    def __init__(
        self, ctx: WorkerContext, control: Control, loader: VersionLoader, flusher: Flusher
    ) -> None:
        self.ctx = ctx
        self.control = control
        self.loader = loader
        self.flusher = flusher  # the run's: jobs an earlier incarnation held go back through it
        self.consumers: dict[str, StreamConsumer[Job]] = {}  # of the steps read now
        self.staleness = 0  # the run's max_staleness: steps version .. version + k are read
        # jobs an earlier incarnation of this worker (same name) read and never finished are
        # pending under its name: handed back once, at this incarnation's first version
        self.earlier_pending = True
        # the last read found no job and the worker holds none: the next round waits for a
        # new version (woken by its announcement) and then reads without waiting
        self.idle = False

    async def start(self) -> None:
        """Read what the worker needs of the run's spec, as it starts serving the run."""
        self.staleness = await self._staleness(self.ctx.run_id)
        self.loader.staleness = self.staleness
        self.ctx.share_drafts = await self._drafts(self.ctx.run_id)

    async def run_forever(self) -> None:
        await self.start()
        while True:
            await self._round()

    async def _round(self) -> None:
        """Look at the run's version and the worker's room once, and read what fits."""
        ctx, run_id = self.ctx, self.ctx.run_id
        if ctx.w.crashed:  # take no more work: the service is going down
            ctx.w.state = "crashed"
            await asyncio.sleep(IDLE_S)
            return
        await self.control.read()
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
            if ctx.version == latest and self.earlier_pending:
                await self._hand_back_earlier(latest)
            if ctx.version == latest and not ctx.w.crashed:
                # its jobs are queued already: read them now, after the orders (a pause may
                # have come meanwhile), without looking at the run and its version again
                await self.control.read()
                if not ctx.paused:
                    await self._read_jobs(run_id, latest)
        elif ctx.paused:  # stepped aside until the next version
            ctx.w.state = "paused"
            await asyncio.sleep(VERSION_WAIT_S)
        else:
            await self._read_jobs(run_id, latest)

    async def _staleness(self, run_id: str) -> int:
        """The run's max_staleness (keys.run_staleness; 0 where it is not there)."""
        raw = await with_reconnect(lambda: self.ctx.r.get(keys.run_staleness(run_id)), "staleness")
        return int(raw) if raw is not None and raw.isdigit() else 0

    async def _drafts(self, run_id: str) -> bool:
        """Whether the run's spec has drafts on (keys.run_drafts; off where it is not there)."""
        raw = await with_reconnect(lambda: self.ctx.r.get(keys.run_drafts(run_id)), "drafts")
        return raw is not None

    async def _read_jobs(self, run_id: str, version: int) -> None:
        """Read as many jobs as there are free slots, up to the plateau and to each step's read
        cap (an equal share: the coordinator keeps it current), from the jobs of the steps
        this version may generate (the version's own step, then, with max_staleness k, the
        next k, oldest first: a step the trainer waits for comes first); park and acknowledge
        malformed ones."""
        ctx = self.ctx
        steps = [version + i for i in range(self.staleness + 1)]
        if self.staleness:  # only the steps queued so far
            queued = await ctx.r.exists(*[keys.jobs_stream(run_id, s) for s in steps[1:]])
            steps = steps[: 1 + queued] if queued else steps[:1]
        self.consumers = {
            stream: c
            for stream, c in self.consumers.items()
            if stream in {keys.jobs_stream(run_id, s) for s in steps}
        }
        part = await self._fleet_part(run_id) if len(ctx.w.lanes) > 1 else None
        got, room = 0, False
        for i, step in enumerate(steps):
            cap = await self._read_cap(run_id, step)
            free = min(
                min(ctx.s.slots, ctx.plateau.plateau()) - ctx.w.busy,  # the worker's room
                (ctx.s.slots if cap is None else cap) - ctx.busy,  # this run's on this worker
                (ctx.s.slots if part is None else part) - ctx.busy,  # its part of the fleet's
            )
            if cap is None:
                # no cap yet: the step may not be queued, and a blocked read of many would
                # take them all the moment it is (the cap comes in the same MULTI); read one
                # at a time until there is one (with fair reads off there never is)
                free = min(free, 1)
            if free <= 0:
                continue
            room = True
            ctx.w.state = "serving"
            jobs = self._consumer(keys.jobs_stream(run_id, step))
            last = i == len(steps) - 1
            # the last stream waits for jobs when none came from the others
            block = None if self.idle or not last or got else READ_BLOCK_MS
            read = await jobs.read(free, block)
            got += len(read.messages)
            for entry_id, job in read.messages:
                ctx.inbox.put(entry_id, job)
            await jobs.park(read, keys.parked_stream(run_id), "jobs")
            if read.parked:
                await ctx.r.xack(jobs.stream, keys.WORKERS_GROUP, *[p[0] for p in read.parked])
        if not room:
            await self._wait_for_slot()
            return
        self.idle = not got and ctx.busy == 0

    async def _hand_back_earlier(self, version: int) -> None:
        """Give back the jobs of the steps in flight that are pending under this worker's name
        from before this process started (an earlier incarnation killed and restarted under
        the same name: its heartbeat never lapsed, so the coordinator cannot reclaim them). The
        coordinator continues each from its collected tokens (release cause `death`)."""
        self.earlier_pending = False
        leases = await self.adopt_pending(version)
        if leases:
            log.warning("handing back %d jobs an earlier incarnation held", len(leases))
            await self.flusher.release(leases, "death")

    async def adopt_pending(self, version: int | None = None) -> list[RequestLease]:
        """The jobs of the steps in flight (from `version`, default the one loaded) pending
        under this worker's name that it does not hold: an earlier incarnation's, or a read
        whose reply never came (the jobs task stopped mid-read as the worker leaves). Each goes
        into the inbox, so that releasing its lease acknowledges it; their leases."""
        ctx = self.ctx
        version = ctx.version if version is None else version
        if version is None:
            return []
        held = {lease.request_id for lease in self.flusher.held()}
        leases = []
        for step in range(version, version + self.staleness + 1):
            stream = keys.jobs_stream(ctx.run_id, step)
            entries = await read_group(
                ctx.r, stream, keys.WORKERS_GROUP, ctx.w.consumer, 10_000, None, start="0"
            )
            for entry in entries:
                job = decode_or_park(Job, entry, []) if entry[1] is not None else None
                if job is None:
                    await ctx.r.xack(stream, keys.WORKERS_GROUP, entry[0])
                    continue
                if job.request_id in held:
                    continue
                ctx.inbox.put(entry[0], job)
                leases.append(
                    RequestLease(request_id=job.request_id, lease=job.lease, grant=job.grant)
                )
        return leases

    async def _fleet_part(self, run_id: str) -> int | None:
        """This worker's part of the slots the fleet allots the run (`worker_part`), where it
        serves several runs at once, and at least the run's weighted part of the worker; None
        where the placer allots none now."""
        allotment = await self._allotment()
        if allotment is None:
            return None
        shares = {run: allotment.shares.get(run, 1.0) for run in self.ctx.w.lanes}
        floor = shares.get(run_id, 1.0) / sum(shares.values())
        return worker_part(allotment.runs.get(run_id, 0), allotment.slots, self.ctx.s.slots, floor)

    async def _allotment(self) -> FleetAllotment | None:
        """The fleet's allotment (keys.FLEET_ALLOT), read at most once per ALLOT_FRESH_S for
        every lane of the worker; None where the placer published none (or none readable)."""
        w = self.ctx.w
        if time.monotonic() - w.allotment_read_at >= ALLOT_FRESH_S:
            raw = await w.r.get(keys.FLEET_ALLOT)
            w.allotment_read_at = time.monotonic()
            try:
                w.allotment = FleetAllotment.decode(raw) if isinstance(raw, bytes) else None
            except MalformedMessage:
                w.allotment = None
        return w.allotment

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
        if stream not in self.consumers:
            self.consumers[stream] = StreamConsumer(
                self.ctx.r, stream, keys.WORKERS_GROUP, self.ctx.w.consumer, Job, replay=False
            )
        return self.consumers[stream]

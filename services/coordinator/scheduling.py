"""The asyncio shell around the seeding controller and the balancer for one step: who is in
which pool, when the reserved pool steps aside, and which worker releases how many requests.
All decisions come from `seeding.py` and `balancer.py`; this module only reads Redis and sends
orders.
"""

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis
from prometheus_client import Gauge

from services.contracts import keys
from services.contracts.messages import Heartbeat, MalformedMessage, WorkerControl
from services.core.balancer import ReleaseGate, WorkerLoad, equal_caps, read_cap, releases
from services.core.seeding import recall, seeding_over

log = logging.getLogger(__name__)
WORKERS = Gauge("spotrl_coordinator_workers", "Alive workers on the active run", ["pool"])
T_SEED = Gauge("spotrl_coordinator_t_seed_seconds", "Seeding window of the current step")


async def registered_workers(r: aioredis.Redis) -> list[str]:
    """The ids in the worker index (alive or not), in no particular order."""
    # our connections answer bytes (redis-py types a reply bytes | str)
    return [x.decode() for x in cast(set[bytes], await r.smembers(keys.WORKER_INDEX))]


async def heartbeats(r: aioredis.Redis) -> dict[str, Heartbeat]:
    """Every registered worker whose heartbeat is fresh, whatever it serves."""
    ids = sorted(await registered_workers(r))
    beats: list[bytes | None] = []
    if ids:
        beats = cast(list[bytes | None], await r.mget([keys.worker_heartbeat(w) for w in ids]))
    out = {}
    for worker_id, raw in zip(ids, beats, strict=True):
        if raw is None:
            continue
        try:
            out[worker_id] = Heartbeat.decode(raw)
        except MalformedMessage:
            continue
    return out


async def crash_reports(r: aioredis.Redis, worker_ids: list[str]) -> dict[str, dict]:
    """The crash report of each of these workers that has one (JSON, see keys.worker_crash)."""
    if not worker_ids:
        return {}
    raw = await r.mget([keys.worker_crash(w) for w in worker_ids])
    out = {}
    for worker_id, value in zip(worker_ids, raw, strict=True):
        if value is None:
            continue
        try:
            report = json.loads(value)
        except ValueError:
            continue
        if isinstance(report, dict):
            out[worker_id] = report
    return out


async def forget_gone_workers(
    r: aioredis.Redis, alive: set[str], now: float, after_s: float
) -> list[str]:
    """Drop the workers gone (no heartbeat) for `after_s` from the worker index, with their
    record, control stream and crash report, so that churn over days does not pile up; the ones
    dropped. A worker's `gone_since` is set when it is first seen gone, cleared while alive."""
    ids = await registered_workers(r)
    gone = [w for w in ids if w not in alive]
    async with r.pipeline(transaction=False) as pipe:
        for worker_id in alive & set(ids):
            pipe.hdel(keys.worker(worker_id), "gone_since")
        for worker_id in gone:
            pipe.hsetnx(keys.worker(worker_id), "gone_since", now)
            pipe.hget(keys.worker(worker_id), "gone_since")
        replies = await pipe.execute()
    since = replies[len(replies) - 2 * len(gone) :][1::2]
    stale = [w for w, t in zip(gone, since, strict=True) if t and now - float(t) > after_s]
    forgotten = []
    for worker_id in stale:
        if await r.exists(keys.worker_heartbeat(worker_id)):
            continue  # back since the index was read
        async with r.pipeline(transaction=True) as pipe:
            pipe.srem(keys.WORKER_INDEX, worker_id)
            pipe.delete(
                keys.worker(worker_id),
                keys.worker_control(worker_id),
                keys.worker_crash(worker_id),
                keys.worker_leaving(worker_id),
            )
            await pipe.execute()
        forgotten.append(worker_id)
        log.info("forgot worker %s: gone for over %.0fs", worker_id, after_s)
    return forgotten


async def alive_workers(r: aioredis.Redis, run_id: str) -> dict[str, Heartbeat]:
    """Workers whose heartbeat is fresh and that serve `run_id`."""
    return {w: b for w, b in (await heartbeats(r)).items() if b.run_id == run_id}


def count_pools(workers: dict[str, Heartbeat]) -> dict[str, int]:
    counts = {"reserved": 0, "preemptible": 0}
    for beat in workers.values():
        counts[beat.pool] += 1
    for pool, n in counts.items():
        WORKERS.labels(pool).set(n)
    return counts


def serving(beats: dict[str, Heartbeat], run_id: str, step: int) -> int:
    """The workers that serve the step's version or will once they have loaded it: alive on
    the run or idle (an idle worker follows the active run), not failed, not stepped aside for
    this version."""
    return sum(
        1
        for b in beats.values()
        if b.run_id in (run_id, None) and not b.error and not (b.paused and b.version == step)
    )


CAP_TTL_S = 3600  # a read cap outlives a coordinator that dies mid-step by this long at most


async def order(r: aioredis.Redis, worker_id: str, control: WorkerControl) -> None:
    await r.xadd(keys.worker_control(worker_id), control.fields(), maxlen=1000)


@dataclass
class StepScheduler:
    """Seeding window and load balancing of one step."""

    r: aioredis.Redis
    run_id: str
    step: int
    jobs_stream: str
    window_s: float
    started: float
    seed_start: float | None = None  # when a reserved worker first held the step's weights
    seeded_out: bool = False
    seed_end: float | None = None
    release_gate: ReleaseGate = field(default_factory=ReleaseGate)
    fair_reads: bool = True  # publish the read cap and balance onto equal shares (RunSpec)
    recalled: float | None = None  # when the reserved pool was called back to the step
    staleness: int = 0  # max_staleness: workers holding versions step - k .. step serve it
    clock: Callable[[], float] = time.monotonic  # the monotonic clock of `started` (tests step it)

    async def start(self, workers: dict[str, Heartbeat]) -> None:
        T_SEED.set(self.window_s if self.window_s != float("inf") else -1)
        if await self.r.exists(keys.seed_done(self.run_id, self.step)):
            self.seeded_out, self.seed_end = True, self.started  # a resumed step: already over
            return
        if not any(b.pool == "reserved" for b in workers.values()):
            await self._end_seeding({})  # nothing to seed with: the trainer may start

    async def tick(self, unfinished: int, beats: dict[str, Heartbeat]) -> None:
        """One pass, given the step's unfinished requests (every coordinator shard's) and every
        alive worker's heartbeat (`heartbeats`)."""
        workers = {w: b for w, b in beats.items() if b.run_id == self.run_id}
        count_pools(workers)
        reserved = [b for b in workers.values() if b.pool == "reserved"]
        if self.seed_start is None and any(self._serves(b) for b in reserved):
            self.seed_start = self.clock()  # the window runs from when seeding can start
        n_preemptible = sum(1 for b in workers.values() if b.pool == "preemptible")
        if not self.seeded_out and seeding_over(
            self.clock(), self.seed_start, self.window_s, len(reserved), n_preemptible
        ):
            await self._end_seeding(workers)
        if self.recalled is None and recall(self.seeded_out, n_preemptible, unfinished):
            await self._recall(reserved)
        if self.fair_reads:
            cap = read_cap(unfinished, serving(beats, self.run_id, self.step))
            await self.r.set(keys.read_cap(self.run_id, self.step), cap, ex=CAP_TTL_S)
        await self._balance(unfinished, workers)

    async def finish(self) -> None:
        """Rollout is over; with no preemptible pool the reserved one did it all."""
        if not self.seeded_out:
            await self._end_seeding({})
            self.seed_end = None  # the window never closed during the step

    def _serves(self, beat: Heartbeat) -> bool:
        """Whether the worker holds a version that may generate this step."""
        return beat.version is not None and self.step - self.staleness <= beat.version <= self.step

    async def _end_seeding(self, workers: dict[str, Heartbeat]) -> None:
        reserved = {
            w: b.version
            for w, b in workers.items()
            if b.pool == "reserved" and b.version is not None and self._serves(b)
        }
        for worker_id, version in reserved.items():
            await order(
                self.r,
                worker_id,
                WorkerControl(action="pause", run_id=self.run_id, version=version),
            )
        self.seeded_out, self.seed_end = True, self.clock()
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.set(keys.seed_done(self.run_id, self.step), self.seed_end, ex=3600)
            pipe.xadd(
                keys.seeding_over(self.run_id), {"step": self.step}, maxlen=1, approximate=False
            )
            await pipe.execute()
        if reserved:
            log.info(
                "step %d: seeding window over after %.2fs; %d reserved workers step aside",
                self.step,
                self.seed_end - self.started,
                len(reserved),
            )

    async def _recall(self, reserved: list[Heartbeat]) -> None:
        """No preemptible worker is left: the reserved workers resume the step."""
        self.recalled = self.clock()
        for beat in reserved:
            await order(
                self.r,
                beat.worker_id,
                WorkerControl(
                    action="resume",
                    run_id=self.run_id,
                    # paused at the version it holds (one step's, or an earlier one in flight)
                    version=self.step if not self.staleness else (beat.version or 0),
                ),
            )
        log.warning(
            "step %d: no preemptible worker left; %d reserved workers resume it",
            self.step,
            len(reserved),
        )

    async def _balance(self, unfinished: int, workers: dict[str, Heartbeat]) -> None:
        summary = await self.r.xpending(self.jobs_stream, keys.WORKERS_GROUP)
        executing = {
            (c["name"].decode() if isinstance(c["name"], bytes) else c["name"]): int(c["pending"])
            for c in summary.get("consumers") or []
        }
        queued = unfinished - int(summary.get("pending") or 0)
        loads = [
            WorkerLoad(w, executing.get(w, 0), b.plateau or b.slots)
            for w, b in workers.items()
            if b.version == self.step and not b.paused and not b.error
        ]
        if self.fair_reads:
            loads = equal_caps(loads)
        orders, _ = self.release_gate.due(releases(loads, queued), self.clock())
        for worker_id, count in orders.items():
            await order(
                self.r, worker_id, WorkerControl(action="release", run_id=self.run_id, count=count)
            )
            log.info(
                "step %d: %s holds %d over its cap: release ordered",
                self.step,
                worker_id,
                count,
            )

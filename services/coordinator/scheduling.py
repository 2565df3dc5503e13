"""The asyncio shell around the step controller (`core.step_controller`: the seeding window,
the recall, the read cap and the load balancing of one step), and the worker reads the leader
needs (heartbeats, crash reports, the worker index). All decisions come from the core; this
module only reads Redis and writes what a decision asks for.
"""

import json
import logging
import time
from collections.abc import Callable
from typing import cast

import redis.asyncio as aioredis
from prometheus_client import Gauge

from services.contracts import keys
from services.contracts.consumers import consumer_worker
from services.contracts.messages import Heartbeat, MalformedMessage, WorkerControl
from services.core.step_controller import Actions, StepController
from services.infra.redis_streams import text
from services.infra.redis_users import drop_worker_user
from services.state import worker_record

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
    r: aioredis.Redis, alive: set[str], now: float, after_s: float, drop_users: bool = False
) -> list[str]:
    """Drop the workers gone (no heartbeat) for `after_s` from the worker index, with their
    record, control stream, crash report and signing key (and, with `drop_users`, the Redis
    user minted for each), so that churn over days does not pile up; the ones dropped. A
    worker's `gone_since` is set when it is first seen gone, cleared while alive."""
    ids = await registered_workers(r)
    gone = [w for w in ids if w not in alive]
    since = await worker_record.mark_gone(r, alive & set(ids), gone, now)
    stale = [w for w, t in since.items() if t is not None and now - t > after_s]
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
            pipe.hdel(keys.WORKER_KEYS, worker_id)
            await pipe.execute()
        if drop_users:
            await drop_worker_user(r, worker_id)
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


CAP_TTL_S = 3600  # a read cap outlives a coordinator that dies mid-step by this long at most


async def order(r: aioredis.Redis, worker_id: str, control: WorkerControl) -> None:
    await r.xadd(keys.worker_control(worker_id), control.fields(), maxlen=1000)


class StepScheduler:
    """The leader's shell of one step's `StepController` (the one its deltas go to): reads what
    a tick needs (the step's pending jobs per reader) and writes what it decides in one
    MULTI."""

    def __init__(
        self,
        r: aioredis.Redis,
        control: StepController,
        jobs_stream: str,
        clock: Callable[[], float] = time.monotonic,  # the clock of `started` (tests step it)
    ) -> None:
        self.r, self.control, self.jobs_stream, self.clock = r, control, jobs_stream, clock

    @property
    def seeded_out(self) -> bool:
        return self.control.seeded_out

    @property
    def seed_end(self) -> float | None:
        return self.control.seed_end

    async def start(self, workers: dict[str, Heartbeat], window_s: float, started: float) -> None:
        """The step is opened at `started` (on `clock`) with a seeding window of `window_s`."""
        c = self.control
        T_SEED.set(window_s if window_s != float("inf") else -1)
        seed_done = bool(await self.r.exists(keys.seed_done(c.run_id, c.step)))
        await self._carry_out(c.start(workers, seed_done, window_s, started, self.clock()))

    async def tick(self, unfinished: int, beats: dict[str, Heartbeat]) -> None:
        """One pass, given the step's unfinished requests (every coordinator shard's) and every
        alive worker's heartbeat (`heartbeats`)."""
        count_pools({w: b for w, b in beats.items() if b.run_id == self.control.run_id})
        summary = await self.r.xpending(self.jobs_stream, keys.WORKERS_GROUP)
        executing: dict[str, int] = {}  # by worker (its consumer may carry a secret)
        for c in summary.get("consumers") or []:
            worker = consumer_worker(text(c["name"]) or "")
            executing[worker] = executing.get(worker, 0) + int(c["pending"])
        pending = int(summary.get("pending") or 0)
        actions = self.control.tick(self.clock(), unfinished, beats, executing, pending)
        await self._carry_out(actions)

    async def finish(self) -> None:
        """Rollout is over; with no preemptible pool the reserved one did it all."""
        await self._carry_out(self.control.finish(self.clock()))

    async def _carry_out(self, actions: Actions) -> None:
        """A decision's orders, seeding end and read cap, in one MULTI."""
        c = self.control
        if not (actions.orders or actions.seed_end is not None or actions.read_cap is not None):
            return
        async with self.r.pipeline(transaction=True) as pipe:
            for worker_id, control in actions.orders:
                pipe.xadd(keys.worker_control(worker_id), control.fields(), maxlen=1000)
            if actions.seed_end is not None:
                pipe.set(keys.seed_done(c.run_id, c.step), actions.seed_end, ex=3600)
                over = keys.seeding_over(c.run_id)
                pipe.xadd(over, {"step": c.step}, maxlen=1, approximate=False)
            if actions.read_cap is not None:
                pipe.set(keys.read_cap(c.run_id, c.step), actions.read_cap, ex=CAP_TTL_S)
            await pipe.execute()
        self._log(actions)

    def _log(self, actions: Actions) -> None:
        c = self.control
        if actions.paused and c.seed_end is not None:
            log.info(
                "step %d: seeding window over after %.2fs; %d reserved workers step aside",
                c.step,
                c.seed_end - c.started,
                actions.paused,
            )
        if actions.recalled:
            log.warning(
                "step %d: no preemptible worker left; %d reserved workers resume it",
                c.step,
                actions.resumed,
            )
        for worker_id, count in actions.released.items():
            log.info("step %d: %s holds %d over its cap: release ordered", c.step, worker_id, count)

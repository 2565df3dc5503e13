"""The coordinator's observer: every few seconds it looks at the workers' heartbeats and the
streams, and turns them into what an operator watches: tokens/s by worker and pool, queue depths,
workers joining and leaving (a preemption with notice, or a sudden loss), and the run's pool
timeline for the dashboard.

`RateTracker` is the pure part (heartbeats in, rates and joins/leaves out); `Observer` is the
thin shell that reads Redis and writes gauges, counters and timeline entries.
"""

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.exceptions import ResponseError

from services.contracts import keys
from services.contracts.messages import Heartbeat
from services.coordinator.workers.fleet import forget_gone_workers, heartbeats
from services.infra.redis_failover import primary_of
from services.infra.redis_streams import text, with_reconnect
from services.infra.redis_users import restore_worker_users
from services.state import timeline
from services.state.redis_figures import MIB, RedisMemory, run_streams, stream_lengths
from services.state.run_state import active_run, committed_version

log = logging.getLogger(__name__)
WORKER_TOK_S = Gauge(
    "spotrl_worker_tokens_per_second", "Tokens/s of one worker (heartbeats)", ["worker", "pool"]
)
POOL_TOK_S = Gauge("spotrl_pool_tokens_per_second", "Tokens/s of a pool (heartbeats)", ["pool"])
POOL_SIZE = Gauge("spotrl_pool_workers", "Alive workers by pool, whatever they serve", ["pool"])
QUEUE_DEPTH = Gauge("spotrl_queue_depth", "Entries waiting or in flight, by queue", ["queue"])
STREAM_LEN = Gauge("spotrl_stream_length", "Entries in the active run's streams", ["stream"])
WORKERS_FORGOTTEN = Counter(
    "spotrl_coordinator_workers_forgotten_total", "Workers gone long enough to be forgotten"
)
PREEMPTIONS = Counter(
    "spotrl_coordinator_preemptions_total",
    "Workers that left (notice: released their work on SIGTERM; lost: heartbeat expired)",
    ["pool", "cause"],
)
POOLS = ("reserved", "preemptible")
for _pool in POOLS:
    for _cause in ("notice", "lost"):
        PREEMPTIONS.labels(_pool, _cause)  # exported from the start, at 0


@dataclass
class Changes:
    rates: dict[str, float]  # worker -> tokens/s over the window
    joined: list[str]
    left: dict[str, Heartbeat]  # worker -> its last heartbeat


@dataclass
class RateTracker:
    """Tokens/s per worker from the (time, tokens generated) pairs its heartbeats carry; both
    come from the worker's own clock and counter, so the coordinator's polling jitter drops out."""

    window_s: float = 10.0
    history: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    last: dict[str, Heartbeat] = field(default_factory=dict)

    def update(self, beats: dict[str, Heartbeat]) -> Changes:
        joined = sorted(w for w in beats if w not in self.last)
        left = {w: b for w, b in self.last.items() if w not in beats}
        for worker_id in left:
            self.history.pop(worker_id, None)
        rates = {}
        for worker_id, beat in beats.items():
            points = self.history.setdefault(worker_id, deque())
            if points and beat.tokens_generated < points[-1][1]:
                points.clear()  # the worker restarted under the same name
            if not points or beat.at > points[-1][0]:
                points.append((beat.at, beat.tokens_generated))
            while len(points) > 2 and beat.at - points[1][0] >= self.window_s:
                points.popleft()
            (t0, n0), (t1, n1) = points[0], points[-1]
            rates[worker_id] = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
        self.last = dict(beats)
        return Changes(rates, joined, left)


def pool_rates(changes: Changes, beats: dict[str, Heartbeat]) -> dict[str, float]:
    """Tokens/s of the workers in `beats`, by pool."""
    totals = dict.fromkeys(POOLS, 0.0)
    for worker_id, beat in beats.items():
        totals[beat.pool] += changes.rates[worker_id]
    return totals


def pool_sizes(beats: dict[str, Heartbeat]) -> dict[str, int]:
    sizes = dict.fromkeys(POOLS, 0)
    for beat in beats.values():
        sizes[beat.pool] += 1
    return sizes


async def _group_backlog(r: aioredis.Redis, stream: str, group: str) -> tuple[int, int]:
    """(entries not yet delivered to the group, entries delivered and not acknowledged)."""
    try:
        groups = await r.xinfo_groups(stream)
    except ResponseError:
        return 0, 0  # no such stream yet
    for g in groups:
        if text(g["name"]) == group:
            return int(g.get("lag") or 0), int(g.get("pending") or 0)
    return 0, 0


async def queue_depths(
    r: aioredis.Redis, run_id: str | None, version: int | None
) -> dict[str, int]:
    depths = {"runs": await r.llen(keys.RUN_QUEUE)}
    if run_id is not None and version is not None:
        jobs = keys.jobs_stream(run_id, version)
        waiting, in_flight = await _group_backlog(r, jobs, keys.WORKERS_GROUP)
        deltas = (0, 0)
        for stream in keys.all_deltas_streams(run_id):  # every coordinator shard's
            if not await r.exists(stream):
                break
            waiting_deltas, read_deltas = await _group_backlog(r, stream, keys.COORDINATOR_GROUP)
            deltas = (deltas[0] + waiting_deltas, deltas[1] + read_deltas)
        groups = await _group_backlog(r, keys.groups_stream(run_id), keys.TRAINER_GROUP)
        depths |= {
            "jobs_waiting": waiting,
            "jobs_in_flight": in_flight,
            "deltas": sum(deltas),
            "groups": sum(groups),
        }
    else:
        depths |= dict.fromkeys(("jobs_waiting", "jobs_in_flight", "deltas", "groups"), 0)
    return depths


class Observer:
    def __init__(
        self,
        r: aioredis.Redis,
        period_s: float,
        memory_limit_mb: int = 0,
        forget_workers_after_s: float = 3600.0,
        drop_worker_users: bool = False,
    ) -> None:
        self.r, self.period_s = r, period_s
        self.drop_worker_users = drop_worker_users  # the coordinator mints them
        self.tracker = RateTracker(window_s=max(5 * period_s, 5.0))
        self.memory = RedisMemory(r, memory_limit_mb)
        self.forget_after_s = forget_workers_after_s

    async def forever(self) -> None:
        while True:
            await with_reconnect(self.once, "observe")
            await asyncio.sleep(self.period_s)

    async def once(self) -> None:
        active = await active_run(self.r)
        await self._users_on_primary()
        version = await committed_version(self.r, active) if active else None
        beats = await heartbeats(self.r)
        changes = self.tracker.update(beats)
        await self._joins_and_leaves(changes, beats, active)
        for worker_id, rate in changes.rates.items():
            WORKER_TOK_S.labels(worker_id, beats[worker_id].pool).set(rate)
        rates, sizes = pool_rates(changes, beats), pool_sizes(beats)
        for pool in POOLS:
            POOL_TOK_S.labels(pool).set(rates[pool])
            POOL_SIZE.labels(pool).set(sizes[pool])
        depths = await queue_depths(self.r, active, version)
        for queue, depth in depths.items():
            QUEUE_DEPTH.labels(queue).set(depth)
        memory = await self.memory.read()
        forgotten = await forget_gone_workers(
            self.r, set(beats), time.time(), self.forget_after_s, self.drop_worker_users
        )
        WORKERS_FORGOTTEN.inc(len(forgotten))
        if active is not None:
            lengths = await stream_lengths(self.r, run_streams(active, version))
            for name, n in lengths.items():
                STREAM_LEN.labels(name).set(n)
            serving = {w: v for w, b in beats.items() if (v := b.serving(active)) is not None}
            sample = {
                "step": version,
                "workers": pool_sizes(serving),
                "tokens_per_s": pool_rates(changes, serving),
                "queues": depths,
                "redis_mem_mib": round(memory.used_mib, 1),
                "redis_limit_mib": round(memory.limit_bytes / MIB, 1),
                "streams": lengths,
            }
            await timeline.sample_pool(self.r, active, sample)

    async def _users_on_primary(self) -> None:
        """Where the coordinator mints workers' users: make them on a new primary (a failover:
        they are not replicated), so that each worker logs in again as it was told."""
        primary = primary_of(self.r)
        if not self.drop_worker_users or primary is None:
            return
        made = await restore_worker_users(self.r, primary)
        if made:
            log.warning("redis primary %s: made %d workers' users again", primary, made)

    async def _joins_and_leaves(
        self, changes: Changes, beats: dict[str, Heartbeat], active: str | None
    ) -> None:
        for worker_id in changes.joined:
            beat = beats[worker_id]
            log.info("worker %s (%s) joined", worker_id, beat.pool)
            for run_id in beat.served_runs or ([active] if active else []):
                await timeline.emit(
                    self.r, run_id, "worker_joined", worker=worker_id, pool=beat.pool
                )
        for worker_id, beat in changes.left.items():
            with contextlib.suppress(KeyError):  # never sampled: left within one period
                WORKER_TOK_S.remove(worker_id, beat.pool)
            notice = await self.r.exists(keys.worker_leaving(worker_id))
            cause = "notice" if notice else "lost"
            PREEMPTIONS.labels(beat.pool, cause).inc()
            log.info("worker %s (%s) left: %s", worker_id, beat.pool, cause)
            for run_id in beat.served_runs or ([active] if active else []):
                await timeline.emit(
                    self.r,
                    run_id,
                    "worker_left",
                    worker=worker_id,
                    pool=beat.pool,
                    cause=cause,
                    step=(beat.serving(run_id) or beat).version,
                )

"""Redis memory as a figure and as a brake.

Redis runs with `maxmemory` and `noeviction` (compose and `spotrl up` set them): it never drops a
key to make room, it refuses writes instead. A run's keys are bounded by its step, so memory
only nears the limit when the limit is too small for a step, or something else fills Redis. The
coordinator then applies backpressure: it queues no new step while Redis is above
`high_fraction` of its limit, and the run is `stalled` with a reason that says so, until memory
is back under it. Writes Redis refuses mid-step are retried (`redis_streams.while_out_of_memory`),
never dropped.

`pressure` is pure; `RedisMemory` reads INFO; `MemoryGate` is the shell the rollout manager
awaits before queuing a step.
"""

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import Gauge
from redis.exceptions import ResponseError

from services.contracts import keys
from services.coordinator.runs import RunStore

log = logging.getLogger(__name__)
USED = Gauge("spotrl_redis_used_memory_bytes", "Redis used_memory")
LIMIT = Gauge("spotrl_redis_memory_limit_bytes", "Redis memory limit the coordinator brakes at")
MIB = 1 << 20


@dataclass(frozen=True)
class MemoryReading:
    used_bytes: int
    limit_bytes: int  # 0: no limit known

    @property
    def used_mib(self) -> float:
        return self.used_bytes / MIB


def pressure(reading: MemoryReading, high_fraction: float) -> str | None:
    """Why no new work should be queued (None: go on)."""
    if reading.limit_bytes <= 0:
        return None
    if reading.used_bytes < high_fraction * reading.limit_bytes:
        return None
    return (
        f"redis memory {reading.used_bytes / MIB:.0f} MiB is over {high_fraction:.0%} of its "
        f"limit {reading.limit_bytes / MIB:.0f} MiB: no new step is queued until it falls "
        "(raise maxmemory or SPOTRL_REDIS_MEMORY_LIMIT_MB, or free Redis)"
    )


class RedisMemory:
    """Reads used_memory and the limit: the configured one, else Redis's own maxmemory."""

    def __init__(self, r: aioredis.Redis, limit_mb: int = 0) -> None:
        self.r, self.limit_mb = r, limit_mb

    async def read(self) -> MemoryReading:
        info = await self.r.info("memory")
        limit = self.limit_mb * MIB or int(info.get("maxmemory", 0))
        reading = MemoryReading(int(info["used_memory"]), limit)
        USED.set(reading.used_bytes)
        LIMIT.set(reading.limit_bytes)
        return reading


def run_streams(run_id: str, version: int | None) -> dict[str, str]:
    """The streams of a run whose length an operator watches, by name."""
    streams = {
        "deltas": keys.deltas_stream(run_id),
        "groups": keys.groups_stream(run_id),
        "events": keys.run_events(run_id),
        "pool": keys.run_pool(run_id),
        "parked": keys.parked_stream(run_id),
    }
    if version is not None:
        streams["jobs"] = keys.jobs_stream(run_id, version)
    return streams


async def stream_lengths(r: aioredis.Redis, streams: dict[str, str]) -> dict[str, int]:
    """XLEN of each named stream (0 when absent)."""
    async with r.pipeline(transaction=False) as pipe:
        for key in streams.values():
            pipe.xlen(key)
        lengths = await pipe.execute(raise_on_error=False)
    return {
        name: 0 if isinstance(n, ResponseError) else int(n)
        for name, n in zip(streams, lengths, strict=True)
    }


class MemoryGate:
    def __init__(
        self, r: aioredis.Redis, run_id: str, limit_mb: int, high_fraction: float, poll_s: float
    ) -> None:
        self.memory = RedisMemory(r, limit_mb)
        self.runs = RunStore(r)
        self.run_id, self.high_fraction, self.poll_s = run_id, high_fraction, poll_s

    async def wait_below(self, check_running) -> float:
        """Return once Redis is under its high mark, the seconds waited; meanwhile the run is
        stalled with the reason (and running again after). `check_running` raises when the
        run was cancelled."""
        started = time.monotonic()
        reason = pressure(await self.memory.read(), self.high_fraction)
        if reason is None:
            return 0.0
        log.warning("run %s: %s", self.run_id, reason)
        await self.runs.mark_stalled(self.run_id, reason, time.time())
        while reason is not None:
            await check_running()
            await asyncio.sleep(self.poll_s)
            reason = pressure(await self.memory.read(), self.high_fraction)
        waited = time.monotonic() - started
        await self.runs.mark_running(
            self.run_id, f"redis memory back under its high mark ({waited:.1f}s)"
        )
        log.info("run %s: redis memory back under its high mark after %.1fs", self.run_id, waited)
        return waited

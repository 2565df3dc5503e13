"""The figures of Redis an operator watches and the coordinator brakes on: its memory (used and
the limit: the configured one, else Redis's own `maxmemory`, exported as gauges at each read)
and the lengths of a run's streams, each read in one round trip. The brake itself (no new step
while memory is high) is the coordinator's (`coordinator.step.memory`).
"""

from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import Gauge
from redis.exceptions import ResponseError

from services.contracts import keys

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

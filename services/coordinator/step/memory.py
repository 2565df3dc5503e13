"""Redis memory as a brake.

Redis runs with `maxmemory` and `noeviction` (compose and `spotrl up` set them): it never drops a
key to make room, it refuses writes instead. A run's keys are bounded by its step, so memory
only nears the limit when the limit is too small for a step, or something else fills Redis. The
coordinator then applies backpressure: it queues no new step while Redis is above
`high_fraction` of its limit, and the run is `stalled` with a reason that says so, until memory
is back under it. Writes Redis refuses mid-step are retried (`redis_streams.while_out_of_memory`),
never dropped.

`pressure` is pure; `MemoryGate` is the shell the step loop awaits before queuing a step.
The figure it brakes on is read by `state.redis_figures.RedisMemory` (INFO), as the observer
reads it for the operator.
"""

import asyncio
import logging
import time

import redis.asyncio as aioredis

from services.state.redis_figures import MIB, MemoryReading, RedisMemory
from services.state.runs import RunStore

log = logging.getLogger(__name__)


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

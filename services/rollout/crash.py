"""What a worker does when one of its tasks dies of an error (the engine's, a load's): it writes
a crash report (the error, the requests it was running), gives those requests back with reason
"crash" (run by run, where it serves several), so that they migrate at once and the
coordinator can tell a request that crashes every worker it runs on, and gives back what it had
read but not started (reason "preemption": those had no part in the crash). Then the error
goes on and stops the service.

Losing Redis is not a crash: the task is restarted once Redis is back. This module does not
decide which request is poison (the coordinator does).
"""

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.contracts import keys
from services.rollout.context import WorkerContext, WorkerShared
from services.rollout.lanes import Lanes
from services.state import timeline

log = logging.getLogger(__name__)
CRASH_TTL_S = 24 * 3600  # a crash report stays this long
CRASH_REPORT_S = 10.0  # most time spent reporting a crash before the worker goes anyway
ERROR_CHARS = 500  # of an error kept in a crash report


class CrashReporter:
    def __init__(self, w: WorkerShared, lanes: Lanes) -> None:
        self.w = w
        self.lanes = lanes

    async def reporting(
        self, loop: Callable[[], Awaitable[None]], drives_engine: bool = False
    ) -> None:
        """Run one of the worker's tasks; if it dies of an error, report the crash before the
        error goes on to stop the service. Only the task that drives the engine blames the
        requests the engine was running."""
        try:
            await loop()
        except (RedisConnectionError, RedisTimeoutError, OutOfMemoryError):
            raise  # not a crash: the loop starts again once Redis is back (or has room)
        except Exception as exc:
            try:
                async with asyncio.timeout(CRASH_REPORT_S):  # not wait_for: infra/cancel.py
                    await self._report(exc, drives_engine)
            except Exception:  # the original error matters more; say this one and go on
                log.exception("could not report the crash")
            raise

    async def _report(self, exc: Exception, blame_running: bool) -> None:
        """Write the crash report, then give back, run by run, what the engine was running and
        what it had read but not started."""
        w = self.w
        if w.crashed:
            return  # the other task died first and said so
        w.crashed = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        parts = self.lanes.parts()
        running = {ctx.run_id: ctx.buffer.running() if blame_running else [] for ctx, _ in parts}
        requests = [r.request_id for leases in running.values() for r in leases]
        await self._write_report(parts[0][0] if parts else None, requests)
        log.error("crashed running %d requests: %s", len(requests), w.crashed)
        for ctx, _ in parts:
            await timeline.emit(
                w.r,
                ctx.run_id,
                "worker_crashed",
                worker=w.s.worker_id,
                error=w.crashed,
                requests=[r.request_id for r in running[ctx.run_id]],
            )
        async with w.engine_lock:  # the other task may be in a step
            for ctx, flusher in parts:
                await flusher.release(running[ctx.run_id], "crash")
                await flusher.release(flusher.held(), "preemption")

    async def _write_report(self, first: WorkerContext | None, requests: list[str]) -> None:
        w = self.w
        report = {
            "at": time.time(),
            "error": w.crashed,
            "run_id": first.run_id if first else None,
            "version": first.version if first else None,
            "runs": [ctx.run_id for ctx, _ in self.lanes.parts()],
            "requests": requests,
        }
        await w.r.set(keys.worker_crash(w.s.worker_id), json.dumps(report), ex=CRASH_TTL_S)

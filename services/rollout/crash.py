"""What a worker does when one of its tasks dies of an error (the engine's, a load's): it writes
a crash report (the error, the requests it was running), gives those requests back with reason
"crash", so that they migrate at once and the coordinator can tell a request that crashes
every worker it runs on, and gives back what it had read but not started (reason
"preemption": those had no part in the crash). Then the error goes on and stops the service.

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
from services.rollout.context import WorkerContext
from services.rollout.flusher import Flusher
from services.state import timeline

log = logging.getLogger(__name__)
CRASH_TTL_S = 24 * 3600  # a crash report stays this long
CRASH_REPORT_S = 10.0  # most time spent reporting a crash before the worker goes anyway
ERROR_CHARS = 500  # of an error kept in a crash report


class CrashReporter:
    def __init__(self, ctx: WorkerContext, flusher: Flusher) -> None:
        self.ctx = ctx
        self.flusher = flusher

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
        """Write the crash report, then give back what the engine was running and what it had
        read but not started."""
        ctx = self.ctx
        if ctx.crashed:
            return  # the other task died first and said so
        ctx.crashed = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        running = ctx.buffer.running() if blame_running else []
        requests = [r.request_id for r in running]
        await self._write_report(requests)
        log.error("crashed running %d requests: %s", len(running), ctx.crashed)
        if ctx.run_id is not None:
            await timeline.emit(
                ctx.r,
                ctx.run_id,
                "worker_crashed",
                worker=ctx.s.worker_id,
                error=ctx.crashed,
                requests=requests,
            )
        async with ctx.engine_lock:  # the other task may be in a step
            await self.flusher.release(running, "crash")
            await self.flusher.release(self.flusher.held(), "preemption")

    async def _write_report(self, requests: list[str]) -> None:
        ctx = self.ctx
        report = {
            "at": time.time(),
            "error": ctx.crashed,
            "run_id": ctx.run_id,
            "version": ctx.version,
            "requests": requests,
        }
        await ctx.r.set(keys.worker_crash(ctx.s.worker_id), json.dumps(report), ex=CRASH_TTL_S)

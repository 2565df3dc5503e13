"""Cancelling tasks for sure.

On Python 3.11 a cancellation can be lost: `asyncio.wait_for` drops one that lands just as the
awaitable it waits on finishes (CPython gh-86296, fixed in 3.12), and redis-py sends every
command through `wait_for` while its connection has a socket timeout (5 s by default since
redis-py 8). A task cancelled once in its Redis loop then runs on, and whoever awaits it after
the cancel waits forever: a run that never ended was this. Cancel with `cancel_and_wait`.
"""

import asyncio
from collections.abc import Iterable

RECANCEL_S = 0.1  # a task still running this long after a cancel is cancelled again


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task | None], timeout_s: float | None = None
) -> set[asyncio.Task]:
    """Cancel the tasks and wait for them to end, cancelling again every RECANCEL_S those that
    swallowed it. Their errors are taken (none is logged as never retrieved). Returns the
    tasks still running after `timeout_s` (None: wait for every one)."""
    pending = {t for t in tasks if t is not None}
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    done: set[asyncio.Task] = set()
    while pending:
        for task in pending:
            task.cancel()
        wait = RECANCEL_S if deadline is None else min(RECANCEL_S, deadline - loop.time())
        if wait <= 0:
            break
        ended, pending = await asyncio.wait(pending, timeout=wait)
        done |= ended
    for task in done:
        if not task.cancelled():
            task.exception()
    return pending

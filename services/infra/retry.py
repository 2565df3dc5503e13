"""The one retry loop of spotrl: run an operation again, after a jittered exponential backoff,
while it fails with an error that says "not now" (Redis restarting or at its memory limit, the
coordinator or a weight store unreachable). Any other error propagates at once.

It never retries a cancellation: redis-py can turn a task's cancellation into a connection
error, and a cancelled task must stop, not loop.
"""

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def brief(exc: BaseException, chars: int = 200) -> str:
    """An error's message cut short: redis-py quotes the whole failed command of a pipeline,
    which can hold megabytes of tokens."""
    text = str(exc)
    return text if len(text) <= chars else text[:chars] + "..."


async def retry(
    op: Callable[[], Awaitable[T]],
    what: str,
    on: tuple[type[BaseException], ...],
    *,
    first_delay_s: float = 0.1,
    max_delay_s: float = 5.0,
    on_first_failure: Callable[[BaseException], Awaitable[None]] | None = None,
    log_each: bool = True,
) -> T:
    """Await `op()` until it returns; an error of a class in `on` is logged (`what` names the
    operation) and the call made again after `first_delay_s`, doubling up to `max_delay_s`,
    each wait jittered by 0.5-1.5x. `on_first_failure(exc)` is awaited once, at the first
    failure (to say why something waits); with `log_each` False only that first one is
    logged."""
    delay, failures = first_delay_s, 0
    while True:
        try:
            return await op()
        except on as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError from exc
            failures += 1
            if failures == 1 and on_first_failure is not None:
                await on_first_failure(exc)
            if log_each or failures == 1:
                log.warning("%s: %s; retrying in %.1fs", what, brief(exc), delay)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, max_delay_s)

"""Thin helpers over Redis streams with consumer groups (XREADGROUP, XACK, XAUTOCLAIM).

A reader gets `(entry_id, fields)` pairs; decoding and parking of malformed entries is the
caller's business through `decode_or_park`, so one bad message never stops a loop.
"""

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.messages import FIELD, MalformedMessage, Message

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
Entry = tuple[bytes, dict[bytes, bytes]]
PARKED_MAXLEN = 1000  # entries of a run's parked stream
PARKED_BYTES = 16 * 1024  # of a parked message's content kept


def connect(url: str) -> aioredis.Redis:
    return aioredis.from_url(url, decode_responses=False, health_check_interval=10)


async def ensure_group(r: aioredis.Redis, stream: str, group: str, start: str = "0") -> None:
    """Create the consumer group (and the stream) if missing."""
    try:
        await r.xgroup_create(stream, group, id=start, mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def read_group(
    r: aioredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    count: int,
    block_ms: int,
    start: str = ">",
) -> list[Entry]:
    """Read up to `count` new entries for `consumer` (with `start="0"`: the entries it was given
    before and has not acknowledged); [] on timeout or while the stream or its group does not
    exist yet (or no longer exists)."""
    try:
        reply = await r.xreadgroup(group, consumer, {stream: start}, count=count, block=block_ms)
    except ResponseError as exc:
        if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
            raise
        await asyncio.sleep(block_ms / 1000)
        return []
    if not reply:
        return []
    _, entries = reply[0]
    return list(entries)


async def autoclaim(
    r: aioredis.Redis, stream: str, group: str, consumer: str, min_idle_ms: int, count: int = 100
) -> list[Entry]:
    """Take over entries pending longer than `min_idle_ms` (their reader died)."""
    reply = await r.xautoclaim(stream, group, consumer, min_idle_ms, "0-0", count=count)
    return [e for e in reply[1] if e[1] is not None]


def decode_or_park(cls: type[M], entry: Entry, parked: list[tuple[bytes, str]]) -> M | None:
    """Decode an entry; on failure record (entry_id, reason) in `parked` and return None."""
    entry_id, fields = entry
    try:
        return cls.from_fields(fields)
    except MalformedMessage as exc:
        log.warning("parking malformed entry %s: %s", entry_id, exc)
        parked.append((entry_id, str(exc)))
        return None


async def park(
    r: aioredis.Redis,
    stream: str,
    source: str,
    parked: list[tuple[bytes, str]],
    entries: list[Entry] | None = None,
) -> None:
    """Record parked entries for a person to look at, with (the start of) what they held, from
    `entries`: the source stream deletes them once read. The parked stream is capped."""
    if not parked:
        return
    held = {entry_id: fields for entry_id, fields in entries or [] if fields}
    for entry_id, reason in parked:
        body = (held.get(entry_id) or {}).get(FIELD, b"")[:PARKED_BYTES]
        await r.xadd(
            stream,
            {b"source": source, b"entry": entry_id, b"reason": reason, b"m": body},
            maxlen=PARKED_MAXLEN,
            approximate=True,
        )


T = TypeVar("T")


def brief(exc: BaseException, chars: int = 200) -> str:
    """An error's message cut short: redis-py quotes the whole failed command of a pipeline,
    which can hold megabytes of tokens."""
    text = str(exc)
    return text if len(text) <= chars else text[:chars] + "..."


# Redis cannot take the command now, and nothing of it was applied: unreachable, or refusing
# writes at its maxmemory (noeviction). Loops retry these; anything else is a real error.
REDIS_AWAY = (RedisConnectionError, RedisTimeoutError, OutOfMemoryError, OSError)


async def with_reconnect(op: Callable[[], Awaitable[T]], what: str, max_delay_s: float = 5.0) -> T:
    """Run `op`, retrying with jittered backoff while Redis is unreachable or out of memory
    (an operation Redis refused for memory applied nothing: trying it again is safe)."""
    delay = 0.1
    while True:
        try:
            return await op()
        except REDIS_AWAY as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # the client turned our cancellation into a connection error: stop, not retry
                raise asyncio.CancelledError from exc
            log.warning("%s: redis unavailable (%s); retrying in %.1fs", what, brief(exc), delay)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, max_delay_s)


class StagedWrites:
    """Commands staged for one MULTI, kept so that the transaction can be sent again whole (a
    transaction Redis refused for memory, OutOfMemoryError, applied nothing). Stage as on a
    pipeline:
    `staged.hset(key, field, value)`; `await staged.execute(r)` sends them."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        def stage(*args, **kwargs) -> None:
            self.ops.append((name, args, kwargs))

        return stage

    async def execute(self, r: aioredis.Redis) -> list:
        async with r.pipeline(transaction=True) as pipe:
            for name, args, kwargs in self.ops:
                getattr(pipe, name)(*args, **kwargs)
            return await pipe.execute()


async def while_out_of_memory(
    op: Callable[[], Awaitable[T]],
    what: str,
    on_wait: Callable[[str], Awaitable[None]] | None = None,
    max_delay_s: float = 2.0,
) -> T:
    """Run `op`, retrying with backoff while Redis refuses writes for memory; `on_wait(reason)`
    is awaited once when the first refusal comes (to say why the run waits)."""
    delay, told = 0.05, False
    while True:
        try:
            return await op()
        except OutOfMemoryError as exc:
            if not told:
                log.warning("%s: redis is out of memory (%s); waiting", what, brief(exc))
                if on_wait is not None:
                    await on_wait(f"redis is out of memory: {what} waits ({brief(exc)})")
                told = True
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, max_delay_s)

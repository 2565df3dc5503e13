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
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.messages import MalformedMessage, Message

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
Entry = tuple[bytes, dict[bytes, bytes]]


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


async def park(r: aioredis.Redis, stream: str, source: str, parked: list[tuple[bytes, str]]):
    for entry_id, reason in parked:
        await r.xadd(stream, {b"source": source, b"entry": entry_id, b"reason": reason})


T = TypeVar("T")


async def with_reconnect(op: Callable[[], Awaitable[T]], what: str, max_delay_s: float = 5.0) -> T:
    """Run `op`, retrying with jittered backoff while Redis is unreachable."""
    delay = 0.1
    while True:
        try:
            return await op()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # the client turned our cancellation into a connection error: stop, not retry
                raise asyncio.CancelledError from exc
            log.warning("%s: redis unavailable (%s); retrying in %.1fs", what, exc, delay)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, max_delay_s)

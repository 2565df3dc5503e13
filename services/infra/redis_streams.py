"""Thin helpers over Redis streams with consumer groups (XREADGROUP, XACK, XAUTOCLAIM).

`StreamConsumer` is the one way a service reads a stream of messages: read (replaying what it
was given before a restart), decode or set aside the bad entry to park, acknowledge; one bad
message never stops a loop.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import StreamRangeResponse, XReadGroupResponse, XReadResponse

from services.contracts.messages import FIELD, MalformedMessage, Message
from services.infra.redis_failover import connect_sentinel
from services.infra.retry import brief, retry
from services.infra.sentinel_url import parse_sentinel_url

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
T = TypeVar("T")
Entry = tuple[bytes, dict[bytes, bytes]]
PARKED_MAXLEN = 1000  # entries of a run's parked stream
PARKED_BYTES = 16 * 1024  # of a parked message's content kept


def text(raw: bytes | str | None) -> str | None:
    """A Redis reply as text (our connections answer bytes; redis-py types a reply bytes | str)."""
    return raw.decode() if isinstance(raw, bytes) else raw


def range_entries(reply: StreamRangeResponse | None) -> list[Entry]:
    """The entries of an XRANGE or XREVRANGE reply, or of an XAUTOCLAIM's ([] for none)."""
    # redis-py types the reply for every protocol and decoding; ours (RESP2, bytes) gives
    # [(id, fields), ...] with bytes ids, field names and values.
    return cast(list[Entry], reply or [])


def read_entries(reply: XReadResponse | XReadGroupResponse) -> list[Entry]:
    """The entries of an XREAD or XREADGROUP reply, stream after stream ([] for none)."""
    # Ours (RESP2, bytes) is [[stream, [(id, fields), ...]], ...], all bytes; redis-py's type also
    # covers the RESP3 dict form.
    streams = cast(list[tuple[bytes, list[Entry]]], reply or [])
    return [entry for _, entries in streams for entry in entries]


def entry_time_s(entry_id: bytes) -> float:
    """When Redis added a stream entry: its id's first part, in unix seconds."""
    return int(entry_id.split(b"-", 1)[0]) / 1000


def connect(
    url: str,
    fail_fast: bool = False,
    retry_once: bool = False,
    ca_file: Path | str | None = None,
) -> aioredis.Redis:
    """A connection pool to Redis. `fail_fast`: no retries inside a command, and short socket
    timeouts, for a reader that must know at once when Redis is gone (it retries by itself).
    `retry_once`: a command whose connection turns out dead (Redis restarted since it was last
    used) is sent once more on a new one, for a pool used now and then (an API's writes).
    `ca_file`: a rediss:// server's certificate is verified against this CA (the setting
    `tls_ca_file`); a redis:// URL ignores it. A redis+sentinel:// URL gives a client of the
    primary its Sentinels point at, which follows a failover (`redis_failover`)."""
    if fail_fast:
        args: dict = {
            "retry": Retry(NoBackoff(), 0),
            "socket_connect_timeout": 1.0,
            "socket_timeout": 5.0,
        }
    else:
        args = {"health_check_interval": 10, "retry": Retry(NoBackoff(), 1) if retry_once else None}
    sentinel = parse_sentinel_url(url)
    if sentinel is not None:
        return connect_sentinel(sentinel, ca_file, decode_responses=False, **args)
    return aioredis.from_url(url, decode_responses=False, **args, **tls_args(url, ca_file))


def tls_args(url: str, ca_file: Path | str | None) -> dict[str, str]:
    """redis-py's keyword for the CA of a rediss:// URL ({} for redis://, which takes none)."""
    if ca_file and url.startswith("rediss://"):
        return {"ssl_ca_certs": str(ca_file)}
    return {}


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
    block_ms: int | None,
    start: str = ">",
) -> list[Entry]:
    """Read up to `count` new entries for `consumer` (with `start="0"`: the entries it was given
    before and has not acknowledged), waiting up to `block_ms` for one (None: not at all); []
    on timeout or while the stream or its group does not exist yet (or no longer exists)."""
    try:
        reply = await r.xreadgroup(group, consumer, {stream: start}, count=count, block=block_ms)
    except ResponseError as exc:
        if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
            raise
        await asyncio.sleep((block_ms or 0) / 1000)
        return []
    return read_entries(reply)


async def autoclaim(
    r: aioredis.Redis, stream: str, group: str, consumer: str, min_idle_ms: int, count: int = 100
) -> list[Entry]:
    """Take over entries pending longer than `min_idle_ms` (their reader died)."""
    reply = await r.xautoclaim(stream, group, consumer, min_idle_ms, "0-0", count=count)
    return [e for e in range_entries(reply[1]) if e[1] is not None]


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


@dataclass
class Read(Generic[M]):
    """What one read of a stream gave: every entry (to acknowledge), the decoded messages in
    order, and (entry_id, reason) of the entries to park (malformed ones; a caller adds those it
    refuses for its own reasons)."""

    entries: list[Entry]
    messages: list[tuple[bytes, M]]
    parked: list[tuple[bytes, str]]

    @property
    def ids(self) -> list[bytes]:
        return [entry_id for entry_id, _ in self.entries]


class StreamConsumer(Generic[M]):
    """One consumer of a stream's consumer group, for messages of type `cls`: with `replay`, it
    first reads the entries it was given before a restart and never acknowledged (once each),
    then new ones. A malformed entry never stops it: it is set aside to be parked. An entry
    trimmed away while pending is only acknowledged. Reads retry while Redis is away."""

    def __init__(
        self,
        r: aioredis.Redis,
        stream: str,
        group: str,
        consumer: str,
        cls: type[M],
        replay: bool = True,
    ) -> None:
        self.r, self.stream, self.group, self.consumer, self.cls = r, stream, group, consumer, cls
        self.replaying = replay
        self._replayed = "0"  # entries after this id are still to replay

    def replay(self) -> None:
        """Read the entries given to this consumer and never acknowledged again, from the first."""
        self.replaying, self._replayed = True, "0"

    async def read(self, count: int, block_ms: int | None) -> Read[M]:
        return self.decode(await self.fetch(count, block_ms))

    async def fetch(self, count: int, block_ms: int | None) -> list[Entry]:
        """The entries of one read, not decoded (`decode` them)."""
        start = self._replayed if self.replaying else ">"
        entries = await with_reconnect(
            lambda: read_group(
                self.r, self.stream, self.group, self.consumer, count, block_ms, start
            ),
            f"read {self.stream}",
        )
        if self.replaying:
            if entries:
                last = entries[-1][0]
                self._replayed = last.decode() if isinstance(last, bytes) else last
            else:
                self.replaying = False
        return entries

    def decode(self, entries: list[Entry]) -> Read[M]:
        read: Read[M] = Read(entries, [], [])
        for entry in entries:
            if entry[1] is None:
                continue
            message = decode_or_park(self.cls, entry, read.parked)
            if message is not None:
                read.messages.append((entry[0], message))
        return read

    async def park(self, read: Read[M], parked_stream: str, source: str) -> None:
        """Record the read's parked entries, with what they held, for a person to look at."""
        await park(self.r, parked_stream, source, read.parked, read.entries)

    def stage_ack(self, pipe, ids: list[bytes], delete: bool = True) -> None:
        """Stage the acknowledgement (and, with `delete`, the deletion) of `ids` on a pipeline
        or `StagedWrites`, to go in the transaction that stores what they carried."""
        if ids:
            pipe.xack(self.stream, self.group, *ids)
            if delete:
                pipe.xdel(self.stream, *ids)

    async def ack(self, ids: list[bytes], delete: bool = False) -> None:
        if ids:
            async with self.r.pipeline(transaction=True) as pipe:
                self.stage_ack(pipe, ids, delete)
                await pipe.execute()


# Redis cannot take the command now, and nothing of it was applied: unreachable, or refusing
# writes at its maxmemory (noeviction). Loops retry these; anything else is a real error.
# A service's background loop is restarted on these; a single operation (`with_reconnect`) is
# also retried on a socket error (OSError) of its own.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OutOfMemoryError)
REDIS_AWAY = (*REDIS_DOWN, OSError)


async def with_reconnect(op: Callable[[], Awaitable[T]], what: str, max_delay_s: float = 5.0) -> T:
    """Run `op`, retrying while Redis is unreachable or out of memory (an operation Redis
    refused for memory applied nothing: trying it again is safe)."""
    return await retry(op, f"{what} (redis unavailable)", REDIS_AWAY, max_delay_s=max_delay_s)


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

    async def say(exc: BaseException) -> None:
        if on_wait is not None:
            await on_wait(f"redis is out of memory: {what} waits ({brief(exc)})")

    return await retry(
        op,
        f"{what} (redis is out of memory)",
        (OutOfMemoryError,),
        first_delay_s=0.05,
        max_delay_s=max_delay_s,
        on_first_failure=say,
        log_each=False,
    )

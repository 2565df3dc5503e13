"""The run pointers every service reads (the active run, its committed version), and changing
a run's state only while it is live (running or stalled), in one step inside Redis.

The coordinator moves a run between running and stalled and fails it; the trainer fails it when
its weights were taken over. Either may race a cancel: a run in a final state is never changed.
"""

from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.runspec import LIVE_STATES
from services.infra.redis_streams import range_entries, text

T = TypeVar("T")


class RunStopped(Exception):
    """The run is no longer live (cancelled, failed, deleted): the loop driving it stops; the
    message is its state."""


# Only while the run is live (ARGV[1], ARGV[2]): HDEL the ARGV[3] fields that follow, then HSET
# the name, value pairs after them.
_SET_IF_LIVE = """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= ARGV[1] and state ~= ARGV[2] then return 0 end
local n = tonumber(ARGV[3])
if n > 0 then redis.call('HDEL', KEYS[1], unpack(ARGV, 4, 3 + n)) end
redis.call('HSET', KEYS[1], unpack(ARGV, 4 + n))
return 1
"""


async def set_if_live(
    r: aioredis.Redis, run_id: str, fields: dict, drop: tuple[str, ...] = ()
) -> bool:
    """Drop `drop` and set `fields` on the run's hash if it is live; whether it was."""
    pairs = [x for kv in fields.items() for x in kv]
    args = [*LIVE_STATES, len(drop), *drop, *pairs]
    return bool(await r.eval(_SET_IF_LIVE, 1, keys.run(run_id), *args))


async def active_run(r: aioredis.Redis) -> str | None:
    """The run the services work on now (the run pointer), or None."""
    return text(await r.get(keys.ACTIVE_RUN))


async def ensure_live(r: aioredis.Redis, run_id: str) -> None:
    """Raise RunStopped (its message the run's state, or "deleted") unless the run is live: running
    or stalled."""
    state = text(await r.hget(keys.run(run_id), "state"))
    if state not in LIVE_STATES:
        raise RunStopped(state or "deleted")


async def committed_version(r: aioredis.Redis, run_id: str) -> int | None:
    """The newest weight version the trainer committed and announced for the run, or None."""
    raw = await r.get(keys.run_version(run_id))
    return int(raw) if raw is not None else None


async def wait_announced(
    r: aioredis.Redis,
    stream: str,
    look: Callable[[], Awaitable[T]],
    ready: Callable[[T], bool],
    block_ms: int,
) -> T:
    """`look()` as soon as its answer is `ready`, else what it answers after `block_ms`.
    It wakes on an entry added to `stream`, the one-entry stream beside the state it looks at:
    the blocking read starts from the entry before the first look, so none added after it is
    missed; a state set without an entry is seen at the latest after `block_ms`."""
    newest = range_entries(await r.xrevrange(stream, count=1))
    last_id = newest[0][0] if newest else b"0-0"
    found = await look()
    if ready(found):
        return found
    await r.xread({stream: last_id}, count=1, block=block_ms)
    return await look()


async def wait_for_version(
    r: aioredis.Redis, run_id: str, newer_than: int | None, block_ms: int
) -> int | None:
    """The run's committed version as soon as it is newer than `newer_than` (None: any), else
    as it is after `block_ms`, woken by the trainer's announcement (`version_announced`)."""

    def newer(version: int | None) -> bool:
        return version is not None and (newer_than is None or version > newer_than)

    return await wait_announced(
        r, keys.version_announced(run_id), lambda: committed_version(r, run_id), newer, block_ms
    )

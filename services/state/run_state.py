"""The run pointers every service reads (the active run, its committed version), whether a
run is live (running or stalled), and waiting for what the trainer and the coordinator announce.
The run's own hash is `run_record`'s."""

from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.runspec import LIVE_STATES
from services.infra.redis_streams import range_entries, text
from services.state import run_record

T = TypeVar("T")


class RunStopped(Exception):
    """The run is no longer live (cancelled, failed, deleted): the loop driving it stops; the
    message is its state."""


async def active_run(r: aioredis.Redis) -> str | None:
    """The oldest active run (the run pointer: the one run the services work on, unless
    several share the fleet), or None."""
    return text(await r.get(keys.ACTIVE_RUN))


async def active_runs(r: aioredis.Redis) -> list[str]:
    """Every active run, oldest first (one, unless several share the fleet). A pointer set by
    a release before ACTIVE_RUNS existed counts, first."""
    async with r.pipeline(transaction=False) as pipe:
        pipe.get(keys.ACTIVE_RUN)
        pipe.zrange(keys.ACTIVE_RUNS, 0, -1)
        pointer, members = await pipe.execute()
    runs = [x.decode() for x in members]
    oldest = text(pointer)
    return runs if oldest is None or oldest in runs else [oldest, *runs]


async def ensure_live(r: aioredis.Redis, run_id: str) -> None:
    """Raise RunStopped (its message the run's state, or "deleted") unless the run is live: running
    or stalled."""
    state = await run_record.read_state(r, run_id)
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

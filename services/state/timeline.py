"""A run's timeline, as two capped Redis streams:

- events: what happened and when (state changes, workers joining and leaving, migrations, steps);
- pool samples: every few seconds, the alive workers by pool and their tokens/s.

The coordinator writes both; the API serves them to the dashboard and `spotrl logs`. Entries are
one JSON field so that readers get numbers, lists and nulls back as they were written.
"""

import json
import time

import redis.asyncio as aioredis

from services.contracts import keys
from services.infra.redis_streams import range_entries

EVENTS_MAXLEN = 20_000
POOL_MAXLEN = 20_000
READ_MAX = 10_000


async def emit(r: aioredis.Redis, run_id: str, kind: str, **detail) -> None:
    """Append one event to a run's timeline."""
    body = {"at": time.time(), "kind": kind, **detail}
    await r.xadd(
        keys.run_events(run_id), {"e": json.dumps(body)}, maxlen=EVENTS_MAXLEN, approximate=True
    )


async def sample_pool(r: aioredis.Redis, run_id: str, sample: dict) -> None:
    body = {"at": time.time(), **sample}
    await r.xadd(
        keys.run_pool(run_id), {"e": json.dumps(body)}, maxlen=POOL_MAXLEN, approximate=True
    )


async def _read(r: aioredis.Redis, stream: str, after: str | None, count: int) -> list[dict]:
    """Entries after the entry id `after` (all when None), oldest first, each with its `id`."""
    start = f"({after}" if after else "-"
    rows = range_entries(
        await r.xrange(stream, min=start, max="+", count=max(1, min(count, READ_MAX)))
    )
    return [{"id": entry_id.decode(), **json.loads(fields[b"e"])} for entry_id, fields in rows]


async def read_events(
    r: aioredis.Redis, run_id: str, after: str | None = None, count: int = READ_MAX
) -> list[dict]:
    return await _read(r, keys.run_events(run_id), after, count)


async def read_pool(
    r: aioredis.Redis, run_id: str, after: str | None = None, count: int = READ_MAX
) -> list[dict]:
    return await _read(r, keys.run_pool(run_id), after, count)

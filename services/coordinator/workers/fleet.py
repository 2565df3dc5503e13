"""The workers as the coordinator reads them: heartbeats, crash reports, the worker index (and
forgetting the workers long gone), the pool counts, and an order sent to one worker. The step's
decisions are the step controller's (`core.step_controller`); its shell is `step/loop.py`.
"""

import json
import logging
from typing import cast

import redis.asyncio as aioredis
from prometheus_client import Gauge

from services.contracts import keys
from services.contracts.messages import Heartbeat, MalformedMessage, WorkerControl
from services.infra.redis_users import drop_worker_user
from services.state import worker_record

log = logging.getLogger(__name__)
WORKERS = Gauge("spotrl_coordinator_workers", "Alive workers on the active run", ["pool"])


async def registered_workers(r: aioredis.Redis) -> list[str]:
    """The ids in the worker index (alive or not), in no particular order."""
    # our connections answer bytes (redis-py types a reply bytes | str)
    return [x.decode() for x in cast(set[bytes], await r.smembers(keys.WORKER_INDEX))]


async def heartbeats(r: aioredis.Redis) -> dict[str, Heartbeat]:
    """Every registered worker whose heartbeat is fresh, whatever it serves."""
    ids = sorted(await registered_workers(r))
    beats: list[bytes | None] = []
    if ids:
        beats = cast(list[bytes | None], await r.mget([keys.worker_heartbeat(w) for w in ids]))
    out = {}
    for worker_id, raw in zip(ids, beats, strict=True):
        if raw is None:
            continue
        try:
            out[worker_id] = Heartbeat.decode(raw)
        except MalformedMessage:
            continue
    return out


async def crash_reports(r: aioredis.Redis, worker_ids: list[str]) -> dict[str, dict]:
    """The crash report of each of these workers that has one (JSON, see keys.worker_crash)."""
    if not worker_ids:
        return {}
    raw = await r.mget([keys.worker_crash(w) for w in worker_ids])
    out = {}
    for worker_id, value in zip(worker_ids, raw, strict=True):
        if value is None:
            continue
        try:
            report = json.loads(value)
        except ValueError:
            continue
        if isinstance(report, dict):
            out[worker_id] = report
    return out


async def forget_gone_workers(
    r: aioredis.Redis, alive: set[str], now: float, after_s: float, drop_users: bool = False
) -> list[str]:
    """Drop the workers gone (no heartbeat) for `after_s` from the worker index, with their
    record, control stream, crash report and signing key (and, with `drop_users`, the Redis
    user minted for each), so that churn over days does not pile up; the ones dropped. A
    worker's `gone_since` is set when it is first seen gone, cleared while alive."""
    ids = await registered_workers(r)
    gone = [w for w in ids if w not in alive]
    since = await worker_record.mark_gone(r, alive & set(ids), gone, now)
    stale = [w for w, t in since.items() if t is not None and now - t > after_s]
    forgotten = []
    for worker_id in stale:
        if await r.exists(keys.worker_heartbeat(worker_id)):
            continue  # back since the index was read
        await worker_record.forget(r, worker_id, drop_key=True)
        if drop_users:
            await drop_worker_user(r, worker_id)
        forgotten.append(worker_id)
        log.info("forgot worker %s: gone for over %.0fs", worker_id, after_s)
    return forgotten


async def alive_workers(r: aioredis.Redis, run_id: str) -> dict[str, Heartbeat]:
    """Workers whose heartbeat is fresh and that serve `run_id`, each beat as that run reads it
    (`Heartbeat.serving`)."""
    beats = await heartbeats(r)
    return {w: v for w, b in beats.items() if (v := b.serving(run_id)) is not None}


def count_pools(workers: dict[str, Heartbeat]) -> dict[str, int]:
    counts = {"reserved": 0, "preemptible": 0}
    for beat in workers.values():
        counts[beat.pool] += 1
    for pool, n in counts.items():
        WORKERS.labels(pool).set(n)
    return counts


async def order(r: aioredis.Redis, worker_id: str, control: WorkerControl) -> None:
    await r.xadd(keys.worker_control(worker_id), control.fields(), maxlen=1000)

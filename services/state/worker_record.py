"""A rollout worker's registration (`keys.worker`, `contracts.records.WorkerRecord`): every
read and write of that hash. The coordinator writes it as a worker registers, and marks when
it first saw the worker gone (no heartbeat: `gone_since`) so that a worker gone for long is
forgotten. Whether a worker is alive is its heartbeat, not this record. A registration and a
forgetting each write the record with the worker index (and its signing key) in one
transaction."""

from collections.abc import Iterable
from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from services.contracts import keys
from services.contracts.records import WorkerRecord
from services.infra.redis_streams import StagedWrites
from services.state.hashes import mapping, read_record, record_of

(GONE_SINCE,) = WorkerRecord.check_names("gone_since")


async def read(r: aioredis.Redis, worker_id: str, *only: str) -> WorkerRecord | None:
    """The worker's record (with `only`: just those fields), or None for no such worker."""
    record = await read_record(r, keys.worker(worker_id), WorkerRecord, only)
    if record is not None:
        record.id = worker_id
    return record


async def read_many(r: aioredis.Redis, worker_ids: Iterable[str]) -> dict[str, WorkerRecord]:
    """The record of each of these workers that has one, in one round trip."""
    ids = list(worker_ids)
    async with r.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.hgetall(keys.worker(worker_id))
        hashes = await pipe.execute()
    out = {}
    for worker_id, raw in zip(ids, hashes, strict=True):
        if raw:
            record = WorkerRecord.from_hash(raw, keys.worker(worker_id))
            record.id = worker_id
            out[worker_id] = record
    return out


def stage_register(pipe: Pipeline | StagedWrites, record: WorkerRecord) -> None:
    """Write a worker's registration (its set fields) on a transaction."""
    pipe.hset(keys.worker(record.id), mapping=mapping(record.fields()))


async def register(r: aioredis.Redis, record: WorkerRecord, signing_key: str | None) -> None:
    """Register a worker in one transaction: its record, its place in the worker index, a new
    incarnation (its leaving mark dropped) and, where workers get one, its signing key."""
    async with r.pipeline(transaction=True) as pipe:
        stage_register(pipe, record)
        pipe.sadd(keys.WORKER_INDEX, record.id)
        pipe.delete(keys.worker_leaving(record.id))
        if signing_key is not None:
            pipe.hset(keys.WORKER_KEYS, record.id, signing_key)
        await pipe.execute()


async def forget(r: aioredis.Redis, worker_id: str, drop_key: bool) -> None:
    """Remove a worker in one transaction: its record, its control stream, its crash report,
    its leaving mark, its place in the worker index and, with `drop_key`, its signing key."""
    async with r.pipeline(transaction=True) as pipe:
        pipe.delete(
            keys.worker(worker_id),
            keys.worker_control(worker_id),
            keys.worker_crash(worker_id),
            keys.worker_leaving(worker_id),
        )
        pipe.srem(keys.WORKER_INDEX, worker_id)
        if drop_key:
            pipe.hdel(keys.WORKER_KEYS, worker_id)
        await pipe.execute()


async def mark_gone(
    r: aioredis.Redis, alive: Iterable[str], gone: list[str], now: float
) -> dict[str, float | None]:
    """Clear `gone_since` of the `alive` workers, set it to `now` for the `gone` ones that have
    none yet; each gone worker's `gone_since` (None where its value is not a number)."""
    since_now = WorkerRecord.to_fields(gone_since=now)[GONE_SINCE]
    async with r.pipeline(transaction=False) as pipe:
        for worker_id in alive:
            pipe.hdel(keys.worker(worker_id), GONE_SINCE)
        for worker_id in gone:
            pipe.hsetnx(keys.worker(worker_id), GONE_SINCE, since_now)
            pipe.hget(keys.worker(worker_id), GONE_SINCE)
        replies = await pipe.execute()
    since = replies[len(replies) - 2 * len(gone) :][1::2]
    return {
        worker_id: WorkerRecord.from_hash({GONE_SINCE: cast(bytes, raw)}, worker_id).gone_since
        for worker_id, raw in zip(gone, since, strict=True)
    }


def queue_read(pipe: Pipeline, worker_id: str) -> None:
    """Queue the read of the hash on a pipeline (many read in one round trip)."""
    pipe.hgetall(keys.worker(worker_id))


def from_reply(worker_id: str, raw: dict) -> WorkerRecord | None:
    """The record of a `queue_read` reply, or None for no hash."""
    if (record := record_of(WorkerRecord, keys.worker(worker_id), raw)) is not None:
        record.id = worker_id
    return record

"""Reading a hash into its typed record (`contracts.records`), the one way the record modules
(`run_record`, `trainer_state`, `worker_record`) read: HGETALL for the whole record, HMGET for
the few fields a hot path needs. The conversion itself is the record's (`from_hash`)."""

from typing import TypeVar, cast

import redis
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from services.contracts.records import HashRecord

R = TypeVar("R", bound=HashRecord)


def mapping(fields: dict[str, str]) -> dict[FieldT, EncodableT]:
    """A record's fields (`to_fields`) as redis-py types an HSET's mapping."""
    return {name: value for name, value in fields.items()}


async def read_record(
    r: aioredis.Redis, key: str, record: type[R], only: tuple[str, ...] = ()
) -> R | None:
    """The record of the hash `key` (with `only`: just those fields, the others at their
    defaults), or None when the hash holds none of them."""
    if not only:
        raw = await r.hgetall(key)
        return record.from_hash(raw, key) if raw else None
    names = record.check_names(*only)
    return _fields_read(key, record, names, await r.hmget(key, list(names)))


def read_record_sync(
    r: redis.Redis, key: str, record: type[R], only: tuple[str, ...] = ()
) -> R | None:
    """`read_record` on a blocking connection (the CLI's)."""
    if not only:
        raw = cast(dict[bytes | str, bytes | str], r.hgetall(key))
        return record.from_hash(raw, key) if raw else None
    names = record.check_names(*only)
    return _fields_read(key, record, names, cast(list, r.hmget(key, list(names))))


def _fields_read(key: str, record: type[R], names: tuple[str, ...], values: list) -> R | None:
    if all(v is None for v in values):
        return None
    return record.from_hash(dict(zip(names, values, strict=True)), key)


def record_of(record: type[R], key: str, raw: dict) -> R | None:
    """The record of an HGETALL reply read on a pipeline (None for no hash)."""
    return record.from_hash(raw, key) if raw else None

"""The trainer's counters of a run (`keys.trainer_state`, `contracts.records.TrainerState`):
every read and write of that hash. Only the trainer writes it, as it commits a version."""

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from services.contracts import keys
from services.contracts.records import TrainerState
from services.infra.redis_streams import StagedWrites
from services.state.hashes import mapping, read_record, record_of

GROUPS_INCOMPLETE, GROUPS_TRAINED = TrainerState.check_names("groups_incomplete", "groups_trained")


async def read(r: aioredis.Redis, run_id: str, *only: str) -> TrainerState | None:
    """The trainer's state of the run (with `only`: just those fields), or None before the
    trainer wrote any."""
    return await read_record(r, keys.trainer_state(run_id), TrainerState, only)


async def set_steps_trained(r: aioredis.Redis, run_id: str, steps: int) -> None:
    """The trainer committed the version trained on step `steps - 1` (a resume's commit)."""
    await r.hset(
        keys.trainer_state(run_id), mapping=mapping(TrainerState.to_fields(steps_trained=steps))
    )


def stage_step_trained(
    pipe: Pipeline | StagedWrites,
    run_id: str,
    step: int,
    groups_trained: int,
    groups_incomplete: int,
) -> None:
    """Count a trained step on a transaction (the one that records its version): `step` done,
    its groups added to the run's totals (HINCRBY: atomic)."""
    key = keys.trainer_state(run_id)
    pipe.hincrby(key, GROUPS_INCOMPLETE, groups_incomplete)
    pipe.hincrby(key, GROUPS_TRAINED, groups_trained)
    pipe.hset(key, mapping=mapping(TrainerState.to_fields(steps_trained=step + 1)))


def queue_read(pipe: Pipeline, run_id: str) -> None:
    """Queue the read of the hash on a pipeline (many read in one round trip)."""
    pipe.hgetall(keys.trainer_state(run_id))


def from_reply(run_id: str, raw: dict) -> TrainerState | None:
    """The record of a `queue_read` reply, or None for no hash."""
    return record_of(TrainerState, keys.trainer_state(run_id), raw)

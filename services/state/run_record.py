"""A run's hash (`keys.run`, `contracts.records.RunRecord`): every read and write of it.

The coordinator creates a run, starts it, moves it between running and stalled, records the
seeding update of each step and counts its quarantined groups; the coordinator or the trainer
ends it (`finish`). A run changes state only in one step inside Redis, from the states allowed:
between running and stalled only while it is live, to a final state only from a state that is
not final, so a cancel that landed first is never overwritten, and a run whose hash is gone is
not written back.

It does not decide anything: when a run stalls or fails is the coordinator's policy.
"""

import time
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from services.contracts import keys
from services.contracts.records import RunRecord
from services.contracts.runspec import FINAL_STATES, LIVE_STATES, RunState
from services.infra.redis_streams import StagedWrites
from services.state import timeline
from services.state.hashes import mapping, read_record, read_record_sync, record_of

NOT_FINAL = ("queued", *LIVE_STATES)  # the states a run may end from
(GROUPS_QUARANTINED,) = RunRecord.check_names("groups_quarantined")

# Only while the run's state is one of the ARGV[1] states that follow: HDEL the fields counted
# next, then HSET the name, value pairs after them; 1 if it did, else 0.
_SET_IF_STATE = """
local state = redis.call('HGET', KEYS[1], 'state')
local n_states = tonumber(ARGV[1])
local allowed = false
for i = 2, 1 + n_states do
  if state == ARGV[i] then allowed = true end
end
if not allowed then return 0 end
local at = 2 + n_states
local n_drop = tonumber(ARGV[at])
if n_drop > 0 then redis.call('HDEL', KEYS[1], unpack(ARGV, at + 1, at + n_drop)) end
if #ARGV > at + n_drop then redis.call('HSET', KEYS[1], unpack(ARGV, at + n_drop + 1)) end
return 1
"""


async def read(r: aioredis.Redis, run_id: str, *only: str) -> RunRecord | None:
    """The run's record (with `only`: just those fields), or None for no such run."""
    record = await read_record(r, keys.run(run_id), RunRecord, only)
    if record is not None:
        record.id = run_id
    return record


def read_sync(r: redis.Redis, run_id: str, *only: str) -> RunRecord | None:
    """`read` on a blocking connection (the CLI's)."""
    record = read_record_sync(r, keys.run(run_id), RunRecord, only)
    if record is not None:
        record.id = run_id
    return record


async def read_state(r: aioredis.Redis, run_id: str) -> RunState | None:
    """The run's state, or None for no such run."""
    record = await read(r, run_id, "state")
    return record.state if record is not None else None


def stage_create(pipe: Pipeline | StagedWrites, record: RunRecord) -> None:
    """Write a new run's record (its set fields) on a transaction."""
    pipe.hset(keys.run(record.id), mapping=mapping(record.fields()))


def stage_start(pipe: Pipeline | StagedWrites, run_id: str, started_at: float) -> None:
    """Mark a run running, started now, on a transaction (its caller checked it was queued)."""
    fields = RunRecord.to_fields(state="running", started_at=started_at)
    pipe.hset(keys.run(run_id), mapping=mapping(fields))


def stage_quarantined(pipe: Pipeline | StagedWrites, run_id: str, groups: int = 1) -> None:
    """Count `groups` more quarantined groups, on a transaction (HINCRBY: atomic)."""
    pipe.hincrby(keys.run(run_id), GROUPS_QUARANTINED, groups)


async def set_seeding(
    r: aioredis.Redis,
    run_id: str,
    t_seed_s: float,
    n_prem_recommended: float,
    preemptible_wanted: int | None,
) -> None:
    """Record the seeding update of the step trained last (see `RunRecord` for the fields)."""
    fields = RunRecord.to_fields(
        t_seed_s=t_seed_s,
        n_prem_recommended=n_prem_recommended,
        preemptible_wanted=preemptible_wanted,
    )
    await r.hset(keys.run(run_id), mapping=mapping(fields))


async def _set_if_state(
    r: aioredis.Redis,
    run_id: str,
    states: tuple[str, ...],
    changes: dict[str, Any],
    drop: tuple[str, ...] = (),
) -> bool:
    fields = RunRecord.to_fields(**changes)
    pairs = [x for kv in fields.items() for x in kv]
    args: list[str | int] = [len(states), *states, len(drop), *RunRecord.check_names(*drop), *pairs]
    return bool(await r.eval(_SET_IF_STATE, 1, keys.run(run_id), *args))


async def set_if_live(
    r: aioredis.Redis, run_id: str, drop: tuple[str, ...] = (), **changes: Any
) -> bool:
    """Drop the fields `drop` and write `changes` (fields of RunRecord) if the run is live
    (running or stalled); whether it was."""
    return await _set_if_state(r, run_id, LIVE_STATES, changes, drop)


async def finish(r: aioredis.Redis, run_id: str, state: RunState, error: str = "") -> bool:
    """End the run in the final `state` (with `error`, the reason users read) and say so on its
    timeline, unless it has ended already or is gone; whether this ended it."""
    if state not in FINAL_STATES:
        raise ValueError(f"{state} is not a final state")
    changes = {"state": state, "finished_at": time.time(), "error": error}
    if not await _set_if_state(r, run_id, NOT_FINAL, changes):
        return False
    await timeline.emit(r, run_id, "state", state=state, error=error)
    return True


def queue_read(pipe: Pipeline, run_id: str) -> None:
    """Queue the read of the hash on a pipeline (many read in one round trip)."""
    pipe.hgetall(keys.run(run_id))


def from_reply(run_id: str, raw: dict) -> RunRecord | None:
    """The record of a `queue_read` reply, or None for no hash."""
    if (record := record_of(RunRecord, keys.run(run_id), raw)) is not None:
        record.id = run_id
    return record

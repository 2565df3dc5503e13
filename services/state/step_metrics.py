"""The metrics row of one RL step (`StepRow`): one Redis hash per step, written by two services.

The coordinator writes the rollout fields when the step's rollout is done and the seeding fields
once the trainer committed the next version; the trainer writes the training fields before it
announces that version. So every field is optional, None meaning "not written (yet)", and
`record_step` writes only the fields that are set, each as its JSON value (numbers keep their
type). A field name that is not in `StepRow` cannot be written (a typo is a TypeError); a field
in Redis that `StepRow` does not know (another version of a service wrote it) is ignored by
readers, and so is a value of the wrong type, with a warning.

JSON has no infinity: the unbounded fields (`UNBOUNDED`: a seeding window or a pool size with no
limit) hold `math.inf` in a row and null in Redis and in the REST API.

It does not compute a metric: the services measure, this module stores and reads.
"""

import json
import logging
import math
from collections.abc import Mapping
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from services.contracts import keys
from services.core.call_errors import CallCount

log = logging.getLogger(__name__)


class StepRow(msgspec.Struct, kw_only=True):
    """One step's metrics. Times are seconds of wall time; counts are per step."""

    step: int | None = None  # the RL step: the key of the row, not a field of its hash

    # ---- rollout: the coordinator, when the step's last group is published ----
    version: int | None = None  # weight version that generated the step's tokens
    reward_mean: float | None = None  # mean reward of the responses of the trained groups
    response_tokens: int | None = None  # response tokens kept (the groups' tokens)
    response_len_mean: float | None = None  # response tokens per request
    rollout_s: float | None = None  # from the step's queueing to its last group published
    tokens_per_s: float | None = None  # response_tokens / rollout_s, all pools together
    stale_deltas: int | None = None  # delta items dropped: sent under a lease that moved on
    tokens_received: int | None = None  # tokens that came in deltas, kept or not
    tokens_discarded: int | None = None  # tokens received and dropped (stale, duplicate)
    regenerated_tokens: int | None = None  # tokens_received - response_tokens
    migrations: dict[str, int] | None = None  # requests migrated, by release reason
    t_seed_s: float | None = None  # the step's seeding window (inf: none, null in Redis)
    seed_s: float | None = None  # from the step's start to the end of its seeding
    workers_reserved: int | None = None  # alive reserved workers when the step started
    workers_preemptible: int | None = None  # alive preemptible workers when it started
    groups_quarantined: int | None = None  # groups dropped: a request crashed too many workers
    reward_errors: int | None = None  # responses whose reward raised, timed out or was not a
    # finite number: each scored 0
    reward_calls: int | None = None  # reward calls made (the share's denominator)
    reward_error_first: str | None = None  # the step's first reward failure: its error line
    # and where in the reward's code (the traceback is in the run's log)
    redis_mem_mib: float | None = None  # Redis used memory at the end of the rollout, MiB
    # multi-turn runs (an environment): model turns per episode, tool calls and their errors,
    # environment calls that failed (the episode ended), environment time, observation tokens
    # (in response_tokens; tokens_per_s counts the generated ones)
    turns_mean: float | None = None
    tool_calls: int | None = None
    tool_errors: int | None = None
    environment_errors: int | None = None
    environment_calls: int | None = None  # environment step() calls (the share's denominator)
    environment_error_first: str | None = None  # the step's first environment failure, short
    max_turns: int | None = None  # the most model turns an episode took (spec or environment)
    environment_s: float | None = None
    observed_tokens: int | None = None
    stream_lengths: dict[str, int] | None = None  # entries of the run's streams, by name
    # speculative decoding (steps where a draft was verified): draft tokens verified, of them
    # kept (the engine's own draws), the rest (wasted compute), and kept per forward pass that
    # verified a draft (each pass also draws one token of its own: tokens per pass = this + 1)
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    wasted_tokens: int | None = None
    accepted_per_forward: float | None = None

    # ---- seeding: the coordinator, once the version trained on the step is committed ----
    t_remote_wait_s: float | None = None  # time the trainer waited on the preemptible pool
    t_seed_next_s: float | None = None  # seeding window chosen for the next step
    n_prem_recommended: float | None = None  # preemptible pool size past which the step gets
    # no shorter (inf: no limit, null in Redis)

    # ---- training: the trainer, before it announces the version trained on the step ----
    policy_loss: float | None = None  # clipped GRPO objective, sequence-weighted mean
    kl: float | None = None  # k3 KL estimate to the initial policy, sequence-weighted mean
    clip_fraction: float | None = None  # share of response tokens whose ratio was clipped
    grad_norm: float | None = None  # gradient norm before clipping
    trained_sequences: int | None = None  # responses trained on
    trained_tokens: int | None = None  # response tokens trained on
    train_s: float | None = None  # from the trainer's start of the step to its commit, waits in
    train_wait_s: float | None = None  # of train_s, idle waiting for groups after seeding
    seed_wait_s: float | None = None  # of train_s, waiting for the reserved pool's seeding
    publish_s: float | None = None  # exporting and committing the version to the weight store
    # the bytes of that version's files: the whole model's, or the adapter's alone (LoRA)
    version_bytes: int | None = None
    train_compute_s: float | None = None  # of train_s, backward passes and optimizer steps
    checkpoint_s: float | None = None  # of train_s, the step blocked on a checkpoint (copying the
    # state; the write itself runs in the background)
    step_s: float | None = None  # wall time of the whole step in the trainer: from the
    # announce of the version that generated it to the commit of the version trained on it
    groups_incomplete: int | None = None  # groups that came with another number of responses
    trainer_resumed: bool | None = None  # the version was committed by a restarted trainer,
    # from its checkpoint (the row's other training fields are from before the restart)


def call_counts(row: StepRow) -> dict[str, CallCount]:
    """The step's calls of user code and their failures, by kind (`core.call_errors`)."""
    return {
        "environment": CallCount(
            row.environment_calls or 0,
            row.environment_errors or 0,
            row.environment_error_first or "",
        ),
        "reward": CallCount(
            row.reward_calls or 0, row.reward_errors or 0, row.reward_error_first or ""
        ),
    }


# the fields of a row's hash (`step` is its key); fields whose infinity is stored as null
FIELDS = tuple(f for f in StepRow.__struct_fields__ if f != "step")
UNBOUNDED = frozenset({"t_seed_s", "n_prem_recommended"})


def _stored(name: str, value: Any) -> Any:
    if name in UNBOUNDED and math.isinf(value):
        return None
    return value


def to_hash(row: StepRow) -> dict[FieldT, EncodableT]:
    """The hash fields of the set fields of `row`, as JSON."""
    return {
        name: json.dumps(_stored(name, value))
        for name in FIELDS
        if (value := getattr(row, name)) is not None
    }


def row_from_values(values: Mapping[str, Any], step: int | None = None) -> StepRow:
    """A row from decoded values (a hash's, or a row of the REST API's JSON): unknown names
    and values of the wrong type are left out; null is infinity for an unbounded field and
    "not written" for any other."""
    known: dict[str, Any] = {}
    for name, value in values.items():
        if name not in FIELDS or (value is None and name not in UNBOUNDED):
            continue
        known[name] = math.inf if value is None else value
    try:
        return msgspec.convert({**known, "step": step}, StepRow)
    except msgspec.ValidationError:
        pass
    good = {}
    for name, value in known.items():
        try:
            msgspec.convert({name: value}, StepRow)
        except msgspec.ValidationError as exc:
            log.warning("step %s: ignoring field %s: %s", step, name, exc)
            continue
        good[name] = value
    return msgspec.convert({**good, "step": step}, StepRow)


def from_hash(raw: Mapping[bytes | str, bytes | str], step: int | None = None) -> StepRow:
    """A row from its hash as HGETALL returns it."""
    values = {}
    for key, value in raw.items():
        name = key.decode(errors="replace") if isinstance(key, bytes) else key
        try:
            values[name] = json.loads(value)
        except ValueError:
            log.warning("step %s: ignoring field %s: not JSON", step, name)
    return row_from_values(values, step)


def row_dict(row: StepRow) -> dict[str, Any]:
    """A row as the REST API shows it: `step`, then the fields written (infinity as null)."""
    out: dict[str, Any] = {"step": row.step}
    for name in FIELDS:
        value = getattr(row, name)
        if value is not None:
            out[name] = _stored(name, value)
    return out


async def record_step(r: aioredis.Redis, run_id: str, step: int, row: StepRow) -> None:
    """Write the set fields of `row` into the step's hash and list the step as recorded."""
    if row.step not in (None, step):
        raise ValueError(f"a row of step {row.step} recorded as step {step}")
    mapping = to_hash(row)
    async with r.pipeline(transaction=True) as pipe:
        if mapping:
            pipe.hset(keys.run_step(run_id, step), mapping=mapping)
        pipe.zadd(keys.run_steps_done(run_id), {str(step): step})
        await pipe.execute()


async def read_step(r: aioredis.Redis, run_id: str, step: int) -> StepRow:
    """The row of `step` (every field None when nothing was written)."""
    return from_hash(await r.hgetall(keys.run_step(run_id, step)), step)


async def read_steps(r: aioredis.Redis, run_id: str) -> list[StepRow]:
    """The rows of every recorded step of the run, by step."""
    steps = [int(s) for s in cast(list[bytes], await r.zrange(keys.run_steps_done(run_id), 0, -1))]
    async with r.pipeline(transaction=False) as pipe:
        for step in steps:
            pipe.hgetall(keys.run_step(run_id, step))
        hashes = await pipe.execute()
    return [from_hash(raw, step) for step, raw in zip(steps, hashes, strict=True)]

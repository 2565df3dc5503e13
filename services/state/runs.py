"""Runs in Redis: submission into a FIFO queue, listing, cancellation, activation, metrics rows,
and what a finished run leaves behind.

A run is a hash `run(id)`; the queue is a list. One run is active at a time, or up to the
coordinator's `max_active_runs` when a trainer of the pool is idle for each (`activate_next`);
ACTIVE_RUN names the oldest active run, ACTIVE_RUNS every one. An active run is running or
stalled (it cannot progress, and says why); it goes between the two only while
it is live, never out of a final state.

A finished run keeps its record, not its scratch (`release_run`). Kept: the run hash and version,
the metrics rows, the events and pool timelines, the trainer's state, the workers' load records
and parked messages. Deleted at once: the jobs stream of every version, the per-step request
tables (requests, tokens, logprobs, versions, published and quarantined groups, step meta), the
seeding flags and the responses kept by prompt for drafts. The groups and deltas streams, which
audits read after a run, stay for `audit_ttl_s` after a success or a failure and go at once after
a cancel. Anything still reading a run when its keys go (a worker, the trainer, the step loop)
sees an absent stream, which the stream helpers read as empty; the scheduler releases them again
once the step loop has stopped, for what it wrote in between.
"""

import contextlib
import logging
import re
import time
import uuid
from typing import cast

import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.records import RunRecord
from services.contracts.runspec import FINAL_STATES, LIVE_STATES, RunSpec, RunState
from services.core.run_admission import Held, TokenLimits, next_to_activate, room_for_another
from services.state import run_record, timeline
from services.state.run_state import active_run, active_runs, committed_version
from services.state.step_metrics import StepRow, read_steps, row_dict

log = logging.getLogger(__name__)
SCAN_COUNT = 1000
UNLINK_BATCH = 1000
NO_LIMITS = TokenLimits()
QUEUE_LOOK = 100  # the queued runs activation looks at, oldest first (past a blocked token's)
WILD = "\x00"  # stands for any part of a key name; no key contains it


# WILD in a key function's step or version slot: the functions only format the number, so the
# pattern is the key name with any step there.
WILD_NUMBER = cast(int, WILD)


def _matcher(names: list[str]) -> re.Pattern[str]:
    """A regex matching any of the key names, each WILD standing for any text."""
    return re.compile(
        "|".join(".*".join(re.escape(part) for part in name.split(WILD)) for name in names)
    )


def scratch_keys(run_id: str) -> re.Pattern[str]:
    """The keys of a run that nothing needs once it is over."""
    return _matcher(
        [
            keys.jobs_stream(run_id, WILD_NUMBER),
            keys.step_meta(run_id, WILD_NUMBER),
            keys.step_requests(run_id, WILD_NUMBER),
            keys.step_log(run_id, WILD_NUMBER),
            keys.step_log(run_id, WILD_NUMBER, WILD_NUMBER),
            keys.step_published(run_id, WILD_NUMBER),
            keys.step_quarantined(run_id, WILD_NUMBER),
            keys.step_meta(run_id, WILD_NUMBER, WILD_NUMBER),
            keys.step_requests(run_id, WILD_NUMBER, WILD_NUMBER),
            keys.step_published(run_id, WILD_NUMBER, WILD_NUMBER),
            keys.step_quarantined(run_id, WILD_NUMBER, WILD_NUMBER),
            keys.step_shards(run_id, WILD_NUMBER),
            keys.shard_metrics(run_id),
            keys.seed_done(run_id, WILD_NUMBER),
            keys.read_cap(run_id, WILD_NUMBER),
            keys.draft_history(run_id),
            keys.draft_history_order(run_id),
            keys.version_announced(run_id),
            keys.run_staleness(run_id),
            keys.run_drafts(run_id),
            keys.run_base(run_id),
            keys.run_manifests(run_id),
            keys.seeding_over(run_id),
            keys.weight_holders(run_id, WILD_NUMBER),
            keys.run_trainer_lease(run_id),
            keys.run_demand(run_id),
        ]
    )


def audit_keys(run_id: str) -> list[str]:
    """The streams audits read after a run (which groups trained, which worker sent what)."""
    return [keys.groups_stream(run_id), *keys.all_deltas_streams(run_id)]


def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


async def release_run(r: aioredis.Redis, run_id: str, state: str, audit_ttl_s: int) -> int:
    """Delete the scratch keys of a run that ended in `state` and put the audit streams on a
    TTL (or delete them, after a cancel); the number of keys deleted."""
    started = time.monotonic()
    scratch = scratch_keys(run_id)
    audit = audit_keys(run_id)
    batch: list[bytes] = []
    deleted = 0
    async for raw in r.scan_iter(match=f"{_glob_escape(keys.run(run_id))}:*", count=SCAN_COUNT):
        if scratch.fullmatch(raw.decode(errors="replace")):
            batch.append(raw)
        if len(batch) >= UNLINK_BATCH:
            deleted += await r.unlink(*batch)
            batch = []
    if batch:
        deleted += await r.unlink(*batch)
    if state == "cancelled" or audit_ttl_s == 0:
        deleted += await r.unlink(*audit)
    else:
        for key in audit:
            await r.expire(key, audit_ttl_s)
    log.info(
        "run %s (%s): %d keys deleted in %.2fs", run_id, state, deleted, time.monotonic() - started
    )
    return deleted


async def deactivate(r: aioredis.Redis, run_id: str) -> None:
    """The run is active no more: out of ACTIVE_RUNS, and ACTIVE_RUN names the oldest run
    still active (or is gone)."""
    await r.zrem(keys.ACTIVE_RUNS, run_id)
    if await active_run(r) == run_id:
        rest = cast(list[bytes], await r.zrange(keys.ACTIVE_RUNS, 0, 0))
        if rest:
            await r.set(keys.ACTIVE_RUN, rest[0])
        else:
            await r.delete(keys.ACTIVE_RUN)


class RunNotFound(LookupError):
    pass


class RunNotCancellable(ValueError):
    pass


class RunFailed(Exception):
    """The run cannot go on (stalled past its timeout, a poison request); the message is the
    reason, shown as the run's error."""


class RunStore:
    def __init__(self, r: aioredis.Redis, audit_ttl_s: int = 600) -> None:
        self.r = r
        self.audit_ttl_s = audit_ttl_s  # how long a finished run's groups and deltas stay

    async def submit(self, spec: RunSpec, owner: str = "") -> str:
        """Queue a run; `owner`: the token it came with (`scopes.owner_of`)."""
        run_id = time.strftime("r%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        now = time.time()
        record = RunRecord(
            id=run_id, spec=spec.model_dump_json(), state="queued", created_at=now, owner=owner
        )
        async with self.r.pipeline(transaction=True) as pipe:
            run_record.stage_create(pipe, record)
            pipe.set(keys.run_staleness(run_id), spec.rollout.max_staleness)
            if spec.rollout.drafts != "off":
                pipe.set(keys.run_drafts(run_id), spec.rollout.drafts)
            if spec.lora.use_peft:
                pipe.set(keys.run_base(run_id), spec.model)
            pipe.zadd(keys.RUN_INDEX, {run_id: now})
            pipe.rpush(keys.RUN_QUEUE, run_id)
            await pipe.execute()
        return run_id

    async def get(self, run_id: str) -> RunRecord:
        record = await run_record.read(self.r, run_id)
        if record is None:
            raise RunNotFound(run_id)
        return record

    async def spec(self, run_id: str) -> RunSpec:
        return (await self.get(run_id)).run_spec()

    async def list_ids(self, limit: int = 100) -> list[str]:
        ids = cast(list[bytes], await self.r.zrevrange(keys.RUN_INDEX, 0, limit - 1))
        return [x.decode() for x in ids]

    async def active(self) -> str | None:
        """The oldest active run, or None."""
        return await active_run(self.r)

    async def active_runs(self) -> list[str]:
        """Every active run, oldest first."""
        return await active_runs(self.r)

    async def activate_next(
        self, max_active: int = 1, idle_trainers: int = 0, per_token: TokenLimits = NO_LIMITS
    ) -> str | None:
        """Make the queued run `run_admission.next_to_activate` names active; None (nothing
        done) where it names none. Runs in the queue that are no longer queued (cancelled)
        leave it."""
        active = await self.active_runs()
        if not room_for_another(len(active), max_active, idle_trainers):
            return None  # the queue is not read
        look = QUEUE_LOOK if per_token.any else 1  # past the first only for a token's limits
        ids = [
            raw.decode()
            for raw in cast(list[bytes], await self.r.lrange(keys.RUN_QUEUE, 0, look - 1))
        ]
        queued = await self._held(ids, ("queued",), per_token.any)
        for gone in set(ids) - {run.run_id for run in queued}:
            await self.r.lrem(keys.RUN_QUEUE, 0, gone)
        held = (
            await self._held(active, LIVE_STATES, per_token.share > 0)
            if per_token.any
            else [Held(run_id, "", 1.0) for run_id in active]
        )
        run_id = next_to_activate(queued, held, max_active, idle_trainers, per_token)
        # taken off the queue by this call only: a cancel that removed it first wins
        if run_id is None or not await self.r.lrem(keys.RUN_QUEUE, 1, run_id):
            return None
        now = time.time()
        async with self.r.pipeline(transaction=True) as pipe:
            run_record.stage_start(pipe, run_id, now)
            pipe.zadd(keys.ACTIVE_RUNS, {run_id: now})
            if not active:
                pipe.set(keys.ACTIVE_RUN, run_id)
            await pipe.execute()
        await timeline.emit(self.r, run_id, "state", state="running")
        return run_id

    async def _held(
        self, run_ids: list[str], states: tuple[str, ...], with_share: bool
    ) -> list[Held]:
        """The runs of `run_ids` in one of `states`, each with its token and (`with_share`;
        else 1) its share."""
        held = []
        for run_id in run_ids:
            fields = ("state", "owner", "spec") if with_share else ("state", "owner")
            record = await run_record.read(self.r, run_id, *fields)
            if record is None or record.state not in states:
                continue
            share = 1.0
            if with_share:
                with contextlib.suppress(ValueError):  # not a spec: the default weight
                    share = record.run_spec().rollout.share
            held.append(Held(run_id, record.owner, share))
        return held

    async def pause(self, run_id: str) -> bool:
        """Pause a live run: no new step opens until `resume` (the steps in flight finish);
        whether it was live. Pausing a paused run changes nothing."""
        record = await self.get(run_id)
        if record.paused_at is not None:
            return record.state in LIVE_STATES
        if not await run_record.set_if_live(self.r, run_id, paused_at=time.time()):
            return False
        await timeline.emit(self.r, run_id, "paused")
        return True

    async def resume(self, run_id: str) -> bool:
        """Let a paused live run open steps again; whether it is live."""
        record = await self.get(run_id)
        if not await run_record.set_if_live(self.r, run_id, ("paused_at",)):
            return False
        if record.paused_at is not None:
            await timeline.emit(self.r, run_id, "resumed", paused_s=time.time() - record.paused_at)
        return True

    async def mark_stalled(self, run_id: str, reason: str, since: float) -> bool:
        """A live run cannot progress: say why (False if it is no longer live)."""
        stalled = await run_record.set_if_live(
            self.r, run_id, state="stalled", stall_reason=reason, stalled_since=since
        )
        if not stalled:
            return False
        await timeline.emit(self.r, run_id, "state", state="stalled", reason=reason)
        return True

    async def update_stall_reason(self, run_id: str, reason: str) -> bool:
        return await run_record.set_if_live(self.r, run_id, stall_reason=reason)

    async def mark_running(self, run_id: str, reason: str) -> bool:
        """A stalled run can progress again (False if it is no longer live)."""
        drop = ("stall_reason", "stalled_since")
        if not await run_record.set_if_live(self.r, run_id, drop, state="running"):
            return False
        await timeline.emit(self.r, run_id, "state", state="running", reason=reason)
        return True

    async def finish(self, run_id: str, state: RunState, error: str = "") -> None:
        """End the run (unless it has ended already: a cancel that landed first stays) and
        release what it held."""
        await run_record.finish(self.r, run_id, state, error)
        await release_run(self.r, run_id, state, self.audit_ttl_s)
        await deactivate(self.r, run_id)

    async def cancel(self, run_id: str) -> str:
        run = await self.get(run_id)
        if run.state in FINAL_STATES:
            raise RunNotCancellable(f"run {run_id} is already {run.state}")
        await self.r.lrem(keys.RUN_QUEUE, 0, run_id)
        await self.finish(run_id, "cancelled")
        return "cancelled"

    async def version(self, run_id: str) -> int | None:
        return await committed_version(self.r, run_id)

    async def steps(self, run_id: str) -> list[StepRow]:
        """The run's per-step metrics rows, by step."""
        return await read_steps(self.r, run_id)

    async def metrics(self, run_id: str) -> list[dict]:
        """The rows as the REST API shows them."""
        return [row_dict(row) for row in await self.steps(run_id)]

"""The durable copy of one step's request table (a coordinator shard's: `contracts.shards`), so
that a coordinator killed mid-step (or cut off by a Redis restart) picks the step up where it
was.

What is kept, per step: whether its jobs were queued (and when), each request's lease, finish
reason and the workers that crashed running it, its tokens, their logprobs and the weight versions
that generated them (one record per read in the step's log, below: a read costs Redis one
append, whatever the number of requests it changed, and holds their new tokens only), the groups
already handed to the trainer and those quarantined (dropped: a request of theirs crashed too many
workers), and in a run with an environment each request's episode (`core.episodes`: its turns,
rewards, observations, the spans of tokens it did not generate, a turn awaiting the
environment). The coordinator stages these writes in the same MULTI as the jobs it queues, the
groups it publishes and the deltas it acknowledges, so each batch lands whole or not at all; a
batch that did not land is read again from the coordinator's pending deltas, and applying it
again changes nothing that landed (offsets make deltas idempotent).

Each request's state (its lease, finish reason, crashes and the lease's grant) is written with the
step's first jobs: a restarted coordinator must take the deltas of jobs queued before it, and
knows their grants only from here.

This module opens the step's MULTIs and pipelines, and no other does: an `Effects` value of the
step controller (`core.step_controller`) is written whole by `StepStore.write` (or staged with a
read's acknowledgement by `StepStore.stage`); the leader's reads of a tick (the jobs each reader
of the step's stream holds, the claim of a dead reader's jobs) and `ShardView` (what the other
coordinator shards report of a step) are here too.
"""

import logging
import sys
from array import array
from dataclasses import dataclass, field
from typing import cast

import msgspec
import redis.asyncio as aioredis
from redis.typing import StreamIdT

from services.contracts import keys
from services.contracts.consumers import consumer_worker
from services.contracts.messages import Job, MalformedMessage, RequestLease, WorkerControl
from services.contracts.records import StepMeta
from services.coordinator.step.history import DraftHistory
from services.coordinator.step.record import ShardSummary
from services.core.episodes import Episode, EpisodeTable
from services.core.request_table import RequestTable
from services.core.step_controller import Effects
from services.infra.redis_streams import StagedWrites, text
from services.state import run_record

# The record a coordinator read appends to its step's log (`keys.step_log`): for each request
# the read changed, its new tokens, their logprobs and its new version runs, from the offsets
# where they begin. One record per read per step, whatever the number of requests, so that Redis
# pays one append per read rather than two or three per request; replaying the records in order
# gives back every request's arrays (`replay`). Pure: no Redis.
#
# A record is little-endian: a uint32 count n, then n heads of six uint32 (prompt index, sample
# index, token offset, new tokens k, version-run offset, new runs m), then each entry's data in
# the same order: k int32 tokens, k float64 logprobs, m (offset, version) int32 pairs. An entry
# whose offsets are below what the request holds cuts it there first (a response restarted from
# zero, migration off, is an entry at offset 0).
HEAD_FIELDS = 6
_BIG = sys.byteorder == "big"


@dataclass
class Arrays:
    """A request's arrays as the log replays them."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_runs: list[tuple[int, int]] = field(default_factory=list)


class RecordWriter:
    """The entries of one record, appended one request at a time."""

    def __init__(self) -> None:
        self.heads = array("I")
        self.parts: list[bytes] = []

    def __len__(self) -> int:
        return len(self.heads) // HEAD_FIELDS

    def add(
        self,
        prompt: int,
        sample: int,
        offset: int,
        tokens: list[int],
        logprobs: list[float],
        run_offset: int,
        runs: list[tuple[int, int]],
    ) -> None:
        self.heads.extend((prompt, sample, offset, len(tokens), run_offset, len(runs)))
        token_part, logprob_part = array("i", tokens), array("d", logprobs)
        run_part = array("i", [x for run in runs for x in run])
        if _BIG:
            for part in (token_part, logprob_part, run_part):
                part.byteswap()
        self.parts += (token_part.tobytes(), logprob_part.tobytes(), run_part.tobytes())

    def record(self) -> bytes:
        heads = self.heads
        if _BIG:
            heads = array("I", heads)
            heads.byteswap()
        count = array("I", [len(self)])
        if _BIG:
            count.byteswap()
        return count.tobytes() + heads.tobytes() + b"".join(self.parts)


def _read(kind: str, data: memoryview, at: int, n: int) -> tuple[array, int]:
    out = array(kind)
    end = at + n * out.itemsize
    out.frombytes(data[at:end])
    if _BIG:
        out.byteswap()
    return out, end


def replay(records: list[bytes], into: dict[tuple[int, int], Arrays] | None = None):
    """Apply `records` in order to the arrays of each (prompt, sample); the arrays."""
    out = {} if into is None else into
    for record in records:
        data = memoryview(record)
        (n,), at = _read("I", data, 0, 1)
        heads, at = _read("I", data, at, n * HEAD_FIELDS)
        for i in range(n):
            prompt, sample, offset, k, run_offset, m = heads[HEAD_FIELDS * i : HEAD_FIELDS * i + 6]
            arrays = out.get((prompt, sample))
            if arrays is None:
                arrays = out[(prompt, sample)] = Arrays()
            if offset > len(arrays.token_ids) or run_offset > len(arrays.version_runs):
                raise ValueError(f"a step log entry of {prompt}:{sample} leaves a gap")
            tokens, at = _read("i", data, at, k)
            logprobs, at = _read("d", data, at, k)
            runs, at = _read("i", data, at, 2 * m)
            del arrays.token_ids[offset:], arrays.logprobs[offset:]
            arrays.token_ids += tokens.tolist()
            arrays.logprobs += logprobs.tolist()
            del arrays.version_runs[run_offset:]
            flat = runs.tolist()
            arrays.version_runs += list(zip(flat[::2], flat[1::2], strict=True))
        if at != len(record):
            raise ValueError(f"a step log record of {len(record)} bytes holds {at}")
    return out


log = logging.getLogger(__name__)
TTL_S = 24 * 3600
RESTORE_CHUNK = 256  # log records a restore reads in one round trip
CAP_TTL_S = 3600  # a read cap outlives a coordinator that dies mid-step by this long at most
SEED_TTL_S = 3600
CONTROL_MAXLEN = 1000
CLAIMER = "coordinator"  # the consumer a coordinator claims a dead reader's jobs with
# XCLAIM's reply: (entry id, fields), fields None for an entry deleted while pending
Claimed = list[tuple[bytes, dict[bytes, bytes] | None]]


class StepStore:
    def __init__(
        self,
        r: aioredis.Redis,
        run_id: str,
        step: int,
        shard: int = 0,
        history: DraftHistory | None = None,
    ) -> None:
        """The copy of coordinator shard `shard`'s table (`contracts.shards`); with `history`,
        the responses of each group published are kept for its prompt's next turn
        (`step.history`), in the MULTI that publishes it."""
        self.r, self.history = r, history
        self.jobs = keys.jobs_stream(run_id, step)
        self.meta = keys.step_meta(run_id, step, shard)
        self.state = keys.step_requests(run_id, step, shard)
        self.published = keys.step_published(run_id, step, shard)
        self.quarantined = keys.step_quarantined(run_id, step, shard)
        self.log = keys.step_log(run_id, step, shard)
        self.episodes = keys.step_episodes(run_id, step, shard)
        self.run_id, self.step = run_id, step
        self.saved_len: dict[str, int] = {}  # tokens of each request already in Redis
        self.saved_runs: dict[str, int] = {}  # version runs of each request already in Redis
        # each request's "lease|finish|crashed|grant" in Redis
        self.saved_state: dict[str, str] = {}
        self.expiring: set[str] = set()  # the keys given their TTL
        self._lease_of: dict[str, int] = {}  # each request's lease when its state was staged
        self.written_on = ""  # the Redis primary a restored step was written on (StepMeta)

    async def restore(self, table: RequestTable) -> float | None:
        """Load a step begun earlier into `table`; its start time, or None for a new step."""
        meta = StepMeta.from_hash(await self.r.hgetall(self.meta), self.meta)
        if meta.started_at is None:
            return None
        self.written_on = meta.primary
        # our connections answer bytes (redis-py types a reply bytes | str)
        states = cast(dict[bytes, bytes], await self.r.hgetall(self.state))
        arrays: dict = {}
        at = 0
        while True:
            records = await self.r.lrange(self.log, at, at + RESTORE_CHUNK - 1)
            replay(cast(list[bytes], records), arrays)
            if len(records) < RESTORE_CHUNK:
                break
            at += RESTORE_CHUNK
        for raw_rid, raw in states.items():
            rid = raw_rid.decode()
            req = table.requests.get(rid)
            if req is None:
                continue
            lease, _, rest = raw.decode().partition("|")
            finish, _, rest = rest.partition("|")
            crashed_on, _, grant = rest.rpartition("|")  # a grant is hex: the last "|" is its
            req.lease = int(lease)
            req.grant = grant or req.grant  # never "": a delta must prove something
            req.finish_reason = finish or None  # type: ignore[assignment]
            req.crashed_on = [w for w in crashed_on.split(",") if w]
            self.saved_state[rid] = raw.decode()
            got = arrays.get((req.prompt_index, req.sample_index))
            if got is not None:
                req.token_ids, req.logprobs = got.token_ids, got.logprobs
                req.version_runs = got.version_runs
            self.saved_len[rid] = len(req.token_ids)
            self.saved_runs[rid] = len(req.version_runs)
        if isinstance(table, EpisodeTable):
            await self._restore_episodes(table)
        for p in await self.r.smembers(self.quarantined):
            table.quarantine(int(p))
        done = {int(p) for p in await self.r.smembers(self.published)}
        table.pending_groups -= done
        table.unfinished_count = len(table.unfinished())
        return meta.started_at

    async def _restore_episodes(self, table: EpisodeTable) -> None:
        stored = cast(dict[bytes, bytes], await self.r.hgetall(self.episodes))
        for raw_rid, raw in stored.items():
            rid = raw_rid.decode()
            if rid in table.requests:
                table.episodes[rid] = Episode.restore(raw, table.requests[rid])

    def stage_episodes(self, pipe, table: EpisodeTable, rids: set[str]) -> None:
        """The episodes of these requests (a turn ended, or the environment answered one), in
        the MULTI of the read that changed them."""
        if not rids:
            return
        requests, episodes = table.requests, table.episodes
        pipe.hset(
            self.episodes, mapping={rid: episodes[rid].to_json(requests[rid]) for rid in rids}
        )
        self._expire(pipe, self.episodes)

    def stage_queued(self, pipe, table: RequestTable, started_at: float) -> None:
        """The step's first jobs are queued: every request's state (its grant) with the mark."""
        self.stage_requests(pipe, table, set(table.requests))
        pipe.hset(self.meta, mapping=StepMeta.to_fields(queued=1, started_at=started_at))
        pipe.expire(self.meta, TTL_S)

    def stage_requests(self, pipe, table: RequestTable, rids: set[str]) -> None:
        """Write what changed in these requests since they were last staged, in two commands
        whatever their number: one HSET of the states that changed (lease, finish, crashes) and
        one RPUSH of a log record with their new tokens, logprobs and version runs. This runs
        for every request of every read: names are looked up once."""
        states: dict[str, str] = {}
        record = RecordWriter()
        add = record.add
        requests, saved_len, saved_runs = table.requests, self.saved_len, self.saved_runs
        saved_state, lease_of = self.saved_state, self._lease_of
        for rid in rids:
            req = requests[rid]
            # the state string only where it may have changed: a finish and the crashes are
            # never undone, so with neither, the same lease means the same state (most reads
            # append tokens and change nothing else)
            if req.finish_reason is not None or req.crashed_on or lease_of.get(rid) != req.lease:
                lease_of[rid] = req.lease
                crashed = ",".join(req.crashed_on)
                state = f"{req.lease}|{req.finish_reason or ''}|{crashed}|{req.grant}"
                if saved_state.get(rid) != state:
                    states[rid] = saved_state[rid] = state
            tokens = req.token_ids
            n, saved = len(tokens), saved_len.get(rid, 0)
            if n == saved:  # no token since (and so no new version run)
                continue
            runs = req.version_runs
            if n > saved:
                runs_saved = saved_runs.get(rid, 0)
            else:  # fewer than stored: restarted from zero (migration off), cut there
                saved = runs_saved = 0
            add(
                req.prompt_index,
                req.sample_index,
                saved,
                tokens[saved:],
                req.logprobs[saved:],
                runs_saved,
                runs[runs_saved:],
            )
            saved_len[rid], saved_runs[rid] = n, len(runs)
        if states:
            pipe.hset(self.state, mapping=states)
            self._expire(pipe, self.state)
        if len(record):
            pipe.rpush(self.log, record.record())
            self._expire(pipe, self.log)

    def _expire(self, pipe, key: str) -> None:
        """The key's TTL, staged with its first write (it covers a coordinator that never
        comes back)."""
        if key not in self.expiring:
            pipe.expire(key, TTL_S)
            self.expiring.add(key)

    def stage_published(self, pipe, prompt_index: int) -> None:
        pipe.sadd(self.published, prompt_index)
        pipe.expire(self.published, TTL_S)

    def stage_quarantined(self, pipe, prompt_index: int) -> None:
        """The group is dropped; its quarantined Group goes to the trainer in the same MULTI."""
        pipe.sadd(self.quarantined, prompt_index)
        pipe.expire(self.quarantined, TTL_S)
        self.stage_published(pipe, prompt_index)

    def scratch_keys(self) -> list[str]:
        """Every key of this step's copy."""
        return [self.meta, self.state, self.published, self.quarantined, self.log, self.episodes]

    async def expire_soon(self, ttl_s: int = 600) -> None:
        """The step is over: its copy is kept a while for audits, then goes."""
        async with self.r.pipeline(transaction=False) as pipe:
            for key in self.scratch_keys():
                pipe.expire(key, ttl_s)
            await pipe.execute()

    # -- an effects value, written ----------------------------------------------------------

    async def write(
        self, table: RequestTable, effects: Effects, handed: dict[int, dict] | None = None
    ) -> None:
        """One decision of the step's controller in one MULTI (`stage`)."""
        if not effects.writes:
            return
        async with self.r.pipeline(transaction=True) as pipe:
            self.stage(pipe, table, effects, handed)
            await pipe.execute()

    def stage(
        self, pipe, table: RequestTable, effects: Effects, handed: dict[int, dict] | None = None
    ) -> None:
        """Stage `effects` on a transaction (a pipeline or `StagedWrites`), in the order a
        restart needs them: the read cap before the first jobs, the requests' state with the
        jobs that continue them, the groups with their marks; `handed` is each shard's release
        batch as sent (signed where workers sign their deltas)."""
        run_id = self.run_id
        if effects.read_cap is not None:
            pipe.set(keys.read_cap(run_id, self.step), effects.read_cap, ex=CAP_TTL_S)
        if effects.queued_at is not None:
            self.stage_queued(pipe, table, effects.queued_at)
        else:
            self.stage_requests(pipe, table, effects.rows)
        if effects.primary is not None:
            pipe.hset(self.meta, "primary", effects.primary)
        if effects.episodes and isinstance(table, EpisodeTable):
            self.stage_episodes(pipe, table, effects.episodes)
        for job in effects.jobs:
            pipe.xadd(self.jobs, job.fields())
        for shard, fields in (handed or {}).items():
            pipe.xadd(keys.deltas_stream(run_id, shard), fields)
        if effects.acks:
            pipe.xack(self.jobs, keys.WORKERS_GROUP, *effects.acks)
        if effects.drop_reader is not None:
            pipe.xgroup_delconsumer(self.jobs, keys.WORKERS_GROUP, effects.drop_reader)
        self._stage_groups(pipe, table, effects)
        for worker_id, order in [*fence_orders(run_id, effects.fences), *effects.orders]:
            pipe.xadd(keys.worker_control(worker_id), order.fields(), maxlen=CONTROL_MAXLEN)
        if effects.seed_end is not None:
            pipe.set(keys.seed_done(run_id, self.step), effects.seed_end, ex=SEED_TTL_S)
            over = keys.seeding_over(run_id)
            pipe.xadd(over, {"step": self.step}, maxlen=1, approximate=False)

    def _stage_groups(self, pipe, table: RequestTable, effects: Effects) -> None:
        groups_stream = keys.groups_stream(self.run_id)
        for p in effects.publish:
            pipe.xadd(groups_stream, table.group_message(p).fields())
            self.stage_published(pipe, p)
        if self.history is not None and effects.publish:
            responses = {p: [m.token_ids for m in table.group(p)] for p in effects.publish}
            self.history.stage(pipe, self.step, table.prompts, table.history, responses)
        for p in effects.dropped:
            pipe.xadd(groups_stream, table.dropped_group(p).fields())
            self.stage_quarantined(pipe, p)
            run_record.stage_quarantined(pipe, self.run_id)

    # -- the leader's reads of the step's jobs stream ---------------------------------------

    async def readers(self) -> tuple[dict[str, int], set[str]]:
        """The readers of the step's jobs stream (consumer name -> jobs pending), and those
        of them holding jobs whose heartbeat key is there."""
        pending: dict[str, int] = {}
        for consumer in await self.r.xinfo_consumers(self.jobs, keys.WORKERS_GROUP):
            pending[text(consumer["name"]) or ""] = int(consumer["pending"])
        holding = [name for name, n in pending.items() if n > 0]
        async with self.r.pipeline(transaction=False) as pipe:
            for name in holding:
                pipe.exists(keys.worker_heartbeat(consumer_worker(name)))
            beating = await pipe.execute()
        return pending, {name for name, n in zip(holding, beating, strict=True) if n}

    async def executing(self) -> tuple[dict[str, int], int]:
        """The jobs each worker reading the step's stream holds, and all of them."""
        summary = await self.r.xpending(self.jobs, keys.WORKERS_GROUP)
        executing: dict[str, int] = {}  # by worker (its consumer may carry a secret)
        for c in summary.get("consumers") or []:
            worker = consumer_worker(text(c["name"]) or "")
            executing[worker] = executing.get(worker, 0) + int(c["pending"])
        return executing, int(summary.get("pending") or 0)

    async def claim(self, name: str) -> tuple[list[StreamIdT], list[Job]]:
        """Move every entry reader `name` holds to the coordinator's consumer: their ids, and
        the jobs that can be read (an entry deleted while pending has none)."""
        stream = self.jobs
        pending = await self.r.xpending_range(
            stream, keys.WORKERS_GROUP, min="-", max="+", count=100_000, consumername=name
        )
        ids: list[StreamIdT] = [p["message_id"] for p in pending]
        if not ids:
            return ids, []
        # redis-py types the reply for any connection (text, or ids only with justid); ours
        # answers bytes, and without justid each entry is (id, fields)
        claimed = cast(Claimed, await self.r.xclaim(stream, keys.WORKERS_GROUP, CLAIMER, 0, ids))
        jobs = []
        for entry_id, fields in claimed:
            if fields is None:
                continue
            try:
                jobs.append(Job.from_fields(fields))
            except MalformedMessage as exc:
                log.warning("unreadable job %s held by %s: %s", entry_id, name, exc)
        return ids, jobs


async def write_staged(r: aioredis.Redis, staged: StagedWrites) -> None:
    """One read's MULTI: every step's effects staged (`StepStore.stage`) with its
    acknowledgement, sent whole."""
    await staged.execute(r)


async def loaded_workers(r: aioredis.Redis, run_id: str, ids: list[str]) -> list[str]:
    """Of these workers, those that loaded weights of the run (they served it)."""
    async with r.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.exists(keys.worker_loads(run_id, worker_id))
        loaded = await pipe.execute()
    return [w for w, n in zip(ids, loaded, strict=True) if n]


def fence_orders(
    run_id: str, stale: dict[str, set[tuple[str, int]]]
) -> list[tuple[str, WorkerControl]]:
    """Each worker told to drop the (request, old lease) pairs it sent stale deltas for."""
    out = []
    for worker_id, pairs in stale.items():
        requests = [RequestLease(request_id=rid, lease=lease) for rid, lease in sorted(pairs)]
        out.append((worker_id, WorkerControl(action="abort", run_id=run_id, requests=requests)))
    return out


class ShardView:
    """What shard 0 reads of the other shards' part of one step, and what they report: their
    unfinished requests while the step runs, their summary once their groups are published."""

    def __init__(self, r: aioredis.Redis, run_id: str, step: int, shards: int) -> None:
        self.r, self.key, self.shards = r, keys.step_shards(run_id, step), shards

    async def _fields(self) -> dict[str, bytes]:
        raw = cast(dict[bytes, bytes], await self.r.hgetall(self.key))
        return {k.decode(): v for k, v in raw.items()}

    async def all_done(self) -> bool:
        """Whether every other shard has published all its groups of the step."""
        if self.shards == 1:
            return True
        fields = await self._fields()
        return all(f"{i}:done" in fields for i in range(1, self.shards))

    async def unfinished(self, table: RequestTable) -> int:
        """The other shards' unfinished requests, as last reported (a shard that reported
        nothing yet: all of its requests)."""
        if self.shards == 1:
            return 0
        fields, total = await self._fields(), 0
        for i in range(1, self.shards):
            if f"{i}:done" in fields:
                continue
            reported = fields.get(f"{i}:unfinished")
            total += int(reported) if reported is not None else table.requests_of_shard(i)
        return total

    async def summaries(self) -> list[ShardSummary]:
        fields = await self._fields()
        return [
            msgspec.json.decode(fields[f"{i}:done"], type=ShardSummary)
            for i in range(1, self.shards)
            if f"{i}:done" in fields
        ]

    async def report_unfinished(self, shard: int, n: int) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.key, f"{shard}:unfinished", n)
            pipe.expire(self.key, TTL_S)
            await pipe.execute()

    async def report_done(self, shard: int, summary: ShardSummary) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(
                self.key,
                mapping={f"{shard}:unfinished": 0, f"{shard}:done": msgspec.json.encode(summary)},
            )
            pipe.expire(self.key, TTL_S)
            await pipe.execute()

    async def expire(self, ttl_s: int) -> None:
        if self.shards > 1:
            await self.r.expire(self.key, ttl_s)

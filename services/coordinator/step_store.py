"""The durable copy of one step's request table (a coordinator shard's: `contracts.shards`), so
that a coordinator killed mid-step (or cut off by a Redis restart) picks the step up where it
was.

What is kept, per step: whether its jobs were queued (and when), each request's lease, finish
reason and the workers that crashed running it, its tokens, their logprobs and the weight versions
that generated them (one record per read in the step's log, `step_log.py`: a read costs Redis one
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
"""

from typing import cast

import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.records import StepMeta
from services.coordinator.step_log import RecordWriter, replay
from services.core.episodes import Episode, EpisodeTable
from services.core.request_table import RequestTable

TTL_S = 24 * 3600
RESTORE_CHUNK = 256  # log records a restore reads in one round trip


class StepStore:
    def __init__(self, r: aioredis.Redis, run_id: str, step: int, shard: int = 0) -> None:
        """The copy of coordinator shard `shard`'s table (`contracts.shards`)."""
        self.r = r
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

    async def restore(self, table: RequestTable) -> float | None:
        """Load a step begun earlier into `table`; its start time, or None for a new step."""
        meta = StepMeta.from_hash(await self.r.hgetall(self.meta), self.meta)
        if meta.started_at is None:
            return None
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

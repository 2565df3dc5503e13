"""A rollout worker's pending tokens and its flush decisions. Pure: no Redis, no clock of its
own (`now_s` is the caller's monotonic time, in seconds).

Rules it keeps:
- a request's tokens stay pending from the decode step that made them until a flush that
  carried them was sent (`sent`); a flush that failed leaves them pending, and the next one
  sends them again from the same offset (the coordinator keeps each token once, by offset);
- a flush is due after `flush_steps` decode steps, `flush_ms` after the last flush, or as soon
  as a request finished;
- a flush carries every request with new tokens or a finish, then the requests released;
- tokens go in a batch of the weight version that generated them: a request keeps the version
  it started under (a LoRA engine runs each request under its own adapter, so one flush may
  carry requests of two versions: one batch each, the oldest first, the releases in the last);
- a finished or released request is forgotten once the flush that said so was sent; then, and
  only then, its job entry is acknowledged (a job read but never started is acknowledged when
  it is released);
- a request whose lease moved on (fencing) is forgotten at once, and its job entry is not
  acknowledged by this worker.

It does not drive the engine, read jobs or write to Redis: the worker's flush shell sends the
batch `take` returns, then calls `sent` and acknowledges the entries.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from services.contracts.messages import (
    DeltaBatch,
    DeltaItem,
    FinishReason,
    Job,
    ReleaseReason,
    RequestLease,
)


class Token(Protocol):
    """One generated token, as an engine reports it."""

    request_id: str
    token_id: int
    logprob: float
    finish_reason: FinishReason | None  # set on the request's last token
    drafted: int  # draft tokens verified by the forward pass that made it (its first token)
    accepted: int  # of them, kept


@dataclass
class Pending:
    """A request generating here, with its tokens not yet sent."""

    lease: int
    grant: str  # the job's: every delta and the release echo it (`Job.grant`)
    offset: int  # index in the response of tokens[0]
    isolate: bool = False  # runs with nothing beside it
    version: int | None = None  # the weight version generating it (None: the flush's)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # speculative decoding behind the pending tokens (`TokenEvent.drafted`): sent with them
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def running(self) -> bool:
        return self.finish_reason is None


@dataclass(frozen=True)
class Flush:
    """What one flush sends, and what it settles once sent."""

    batches: list[DeltaBatch]  # one per weight version, the oldest first, releases in the last
    done: list[str]  # request ids forgotten once sent: finished or released
    entry_ids: list[bytes]  # their job entries, to acknowledge once sent
    entry_requests: list[str] = field(default_factory=list)  # whose entries those are

    @property
    def batch(self) -> DeltaBatch:
        """The batch of the newest version (the only one, unless requests of an older
        version still run here), with the releases."""
        return self.batches[-1]

    @property
    def items(self) -> list[DeltaItem]:
        return [item for batch in self.batches for item in batch.items]


class DeltaBuffer:
    def __init__(self, worker_id: str, flush_steps: int, flush_ms: float, now_s: float) -> None:
        self.worker_id = worker_id
        self.flush_steps = flush_steps
        self.flush_ms = flush_ms
        self.pending: dict[str, Pending] = {}
        self.entry_of: dict[str, bytes] = {}  # request id -> job entry id, acked when done
        self.steps_since_flush = 0
        self.finished_since_flush = False
        self.last_flush_s = now_s

    # ---- requests ----
    def start(self, job: Job, entry_id: bytes, version: int | None = None) -> None:
        """A job starts generating (under weight `version`; None: whatever version a flush
        says): its tokens continue the response after its prefix."""
        self.pending[job.request_id] = Pending(
            job.lease, job.grant, len(job.prefix_ids), job.isolate, version
        )
        self.entry_of[job.request_id] = entry_id

    def hold(self, request_id: str, entry_id: bytes) -> None:
        """A job read and never started, about to be released: its entry is acked once sent."""
        self.entry_of[request_id] = entry_id

    def forget(self, request: RequestLease) -> bool:
        """Drop a request whose lease moved on (fencing); False if it is not held under that
        lease. Its job entry is no longer ours to acknowledge."""
        p = self.pending.get(request.request_id)
        if p is None or p.lease != request.lease:
            return False
        del self.pending[request.request_id]
        self.entry_of.pop(request.request_id, None)
        return True

    def clear(self) -> None:
        """Forget every request (a new version or run: they are no longer ours to finish)."""
        self.pending.clear()
        self.entry_of.clear()

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget these requests and their unsent tokens (migrated away: no longer ours)."""
        for rid in request_ids:
            self.pending.pop(rid, None)
            self.entry_of.pop(rid, None)

    def versions(self) -> set[int]:
        """The weight versions the requests still generating started under."""
        return {p.version for p in self.pending.values() if p.running and p.version is not None}

    def running(self) -> list[RequestLease]:
        """The requests still generating, in the order they started."""
        return [
            RequestLease(request_id=rid, lease=p.lease, grant=p.grant)
            for rid, p in self.pending.items()
            if p.running
        ]

    @property
    def isolated_running(self) -> bool:
        """Whether a request that must run alone is generating."""
        return any(p.isolate and p.running for p in self.pending.values())

    # ---- tokens ----
    def record_step(self, tokens: Iterable[Token]) -> int:
        """Keep the tokens of one decode step (those of requests not held are dropped); the
        number of requests that finished."""
        self.steps_since_flush += 1
        finished = 0
        for t in tokens:
            p = self.pending.get(t.request_id)
            if p is None:
                continue
            p.tokens.append(t.token_id)
            p.logprobs.append(t.logprob)
            if t.drafted:
                p.draft_forwards += 1
                p.drafted += t.drafted
                p.accepted += t.accepted
            if t.finish_reason is not None:
                p.finish_reason = t.finish_reason
                finished += 1
        self.finished_since_flush = self.finished_since_flush or finished > 0
        return finished

    def flush_due(self, now_s: float) -> bool:
        return (
            self.finished_since_flush
            or self.steps_since_flush >= self.flush_steps
            or (now_s - self.last_flush_s) * 1000 >= self.flush_ms
        )

    # ---- flushing ----
    def take(
        self,
        now_s: float,
        version: int,
        released: list[RequestLease] | None = None,
        reason: ReleaseReason = "preemption",
    ) -> Flush | None:
        """The flush to send now, or None when there is nothing to say: the tokens of each
        weight version in a batch of its own (a request's: the one it started under, else
        `version`), the releases in `version`'s. The counts towards the next flush start
        again either way. Nothing is forgotten until `sent`."""
        self.steps_since_flush, self.finished_since_flush = 0, False
        self.last_flush_s = now_s
        by_version: dict[int, list[DeltaItem]] = {version: []}
        for rid, p in self.pending.items():
            if p.tokens or not p.running:
                of = version if p.version is None else p.version
                by_version.setdefault(of, []).append(_item(rid, p))
        released = released or []
        items = [item for batch in by_version.values() for item in batch]
        if not items and not released:
            return None
        batches = [
            DeltaBatch(worker_id=self.worker_id, version=v, items=by_version[v])
            for v in sorted(by_version)
            if v != version and by_version[v]
        ]
        if by_version[version] or released or not batches:
            batches.append(
                DeltaBatch(
                    worker_id=self.worker_id,
                    version=version,
                    items=by_version[version],
                    released=released,
                    release_reason=reason,
                )
            )
        done = [i.request_id for i in items if i.finished] + [r.request_id for r in released]
        acked = [rid for rid in done if rid in self.entry_of]
        return Flush(batches, done, [self.entry_of[rid] for rid in acked], acked)

    def sent(self, flush: Flush) -> None:
        """The flush reached the coordinator: drop the tokens it carried (those recorded since
        stay pending) and forget the requests it finished or released."""
        for item in flush.items:
            p = self.pending.get(item.request_id)
            if p is None or p.lease != item.lease:
                continue
            carried = item.offset + len(item.token_ids) - p.offset  # not yet dropped
            if carried > 0:
                del p.tokens[:carried], p.logprobs[:carried]
                p.offset += carried
            p.draft_forwards -= item.draft_forwards  # those recorded since stay pending
            p.drafted -= item.drafted
            p.accepted -= item.accepted
        for rid in flush.done:
            self.pending.pop(rid, None)
            self.entry_of.pop(rid, None)


def _item(request_id: str, p: Pending) -> DeltaItem:
    return DeltaItem(
        request_id=request_id,
        lease=p.lease,
        grant=p.grant,
        offset=p.offset,
        token_ids=list(p.tokens),
        logprobs=list(p.logprobs),
        finished=not p.running,
        finish_reason=p.finish_reason,
        draft_forwards=p.draft_forwards,
        drafted=p.drafted,
        accepted=p.accepted,
    )

"""What a read of token deltas does to a step: the coordinator's collect decision, pure.

`apply_batches` applies the batches of one read to the `RequestTable` (fenced by lease, appended
once) and decides what follows: the requests whose stored state changed, the responses that
finished (to score), the stale deltas to fence, the released requests to continue elsewhere
(their continuation jobs), the crashes that made a request poison, and the groups that poison
dropped. The coordinator's shell then scores, finds the completed groups and writes all of it in
one MULTI; the simulator calls the same function with the batches its workers flush.
"""

from collections import Counter
from dataclasses import dataclass, field

from services.common.messages import DeltaBatch, Job, ReleaseReason
from services.common.runspec import RunSpec
from services.core.request_table import Applied, RequestTable
from services.core.stall import is_poison

# Causes after which a response restarts from zero when token-level migration is off: the worker
# that held it is gone. A hand-off the worker makes itself (seed, balance, crash) keeps them.
LOSING_CAUSES = ("preemption", "death")


def keeps_tokens(migration: bool, cause: str) -> bool:
    """Whether a request moved for `cause` continues from its collected tokens."""
    return migration or cause not in LOSING_CAUSES


@dataclass(frozen=True)
class CollectRules:
    """The run's rules for moving requests (from its RunSpec)."""

    migration: bool = True  # token-level migration: continue from the collected tokens
    max_request_crashes: int = 3  # workers a request may crash (alone) before it is poison
    drop_poison: bool = True  # poison drops its group; else the run fails (the shell raises)

    @classmethod
    def for_run(cls, spec: RunSpec) -> "CollectRules":
        return cls(spec.migration, spec.max_request_crashes, spec.on_poison == "drop_group")


@dataclass
class CollectOutcome:
    changed: set[str] = field(default_factory=set)  # requests whose stored state changed
    finished: list[str] = field(default_factory=list)  # responses complete now: to score
    stale: dict[str, set[tuple[str, int]]] = field(default_factory=dict)  # worker -> to fence
    released: dict[str, list[Job]] = field(default_factory=dict)  # cause -> continuations
    poisoned: list[tuple[str, str]] = field(default_factory=list)  # (request, last worker)
    dropped: list[int] = field(default_factory=list)  # groups quarantined by this read
    tokens_appended: int = 0
    applied: Counter = field(default_factory=Counter)  # Applied value -> delta items


def apply_batches(
    table: RequestTable, batches: list[DeltaBatch], rules: CollectRules
) -> CollectOutcome:
    """Apply `batches` in order: each one's deltas first, then its releases (a worker flushes
    a request's tokens before it gives the request back)."""
    out = CollectOutcome()
    tokens_before, quarantined_before = table.tokens_appended, set(table.quarantined)
    for batch in batches:
        for item in batch.items:
            applied = table.apply(item, batch.version)
            out.applied[applied.value] += 1
            if applied in (Applied.APPENDED, Applied.FINISHED):
                out.changed.add(item.request_id)
            if applied is Applied.FINISHED:
                out.finished.append(item.request_id)
            elif applied is Applied.STALE_LEASE:
                out.stale.setdefault(batch.worker_id, set()).add((item.request_id, item.lease))
        _release(table, batch, rules, out)
    out.tokens_appended = table.tokens_appended - tokens_before
    out.dropped = sorted(table.quarantined - quarantined_before)
    return out


def _release(table: RequestTable, batch: DeltaBatch, rules: CollectRules, out: CollectOutcome):
    cause: ReleaseReason = batch.release_reason
    alone = len(batch.released) == 1
    for rel in batch.released:
        if cause == "crash":
            poison = note_crash(table, rules, rel.request_id, rel.lease, batch.worker_id, alone)
            if poison is not None:
                out.changed.add(rel.request_id)  # its crash count is kept with it
            if poison:
                out.poisoned.append((rel.request_id, batch.worker_id))
                continue
        job = table.migrate(rel.request_id, cause, keeps_tokens(rules.migration, cause), rel.lease)
        if job is not None:
            out.changed.add(rel.request_id)
            out.released.setdefault(cause, []).append(job)


def note_crash(
    table: RequestTable, rules: CollectRules, rid: str, lease: int, worker_id: str, alone: bool
) -> bool | None:
    """`worker_id` crashed running `rid` (`alone`: nothing else ran beside it). None when the
    crash does not count (an old lease, say); else whether the request is now poison. With
    `drop_poison` its group is quarantined at once."""
    if not table.note_crash(rid, lease, worker_id):
        return None
    req = table.requests[rid]
    if not is_poison(len(req.crashed_on), alone, rules.max_request_crashes):
        return False
    if rules.drop_poison:
        table.quarantine(req.prompt_index)
    return True

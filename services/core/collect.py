"""What a read of token deltas does to a step: the coordinator's collect decision, pure.

`apply_batches` applies the batches of one read to the `RequestTable` (fenced by lease, refused
without the lease's grant, appended once) and decides what follows: the requests whose stored
state changed, the responses that finished (to score), the multi-turn episodes whose turn ended
(for the environment, `core.episodes`), the stale deltas to fence, the released requests to
continue elsewhere (their continuation jobs), the crashes that made a request poison, and the
groups that poison dropped. The coordinator's shell then scores, finds the completed groups and
writes all of it in one MULTI; the simulator calls the same function with the batches its
workers flush.
"""

from collections import Counter
from dataclasses import dataclass, field

import msgspec

from services.contracts.messages import DeltaBatch, DeltaItem, Job, ReleaseReason, RequestLease
from services.contracts.runspec import RunSpec
from services.contracts.shards import shard_of
from services.core.request_table import Applied, RequestTable, step_of
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
    # asynchronous RL: a step's tokens come from versions >= step - max_staleness (None: no
    # check, the synchronous run's workers read only their version's jobs)
    max_staleness: int | None = None

    @classmethod
    def for_run(cls, spec: RunSpec) -> "CollectRules":
        return cls(
            spec.rollout.migration,
            spec.faults.max_request_crashes,
            spec.faults.on_poison == "drop_group",
            spec.rollout.max_staleness or None,
        )


@dataclass
class CollectOutcome:
    changed: set[str] = field(default_factory=set)  # requests whose stored state changed
    finished: list[str] = field(default_factory=list)  # responses complete now: to score
    turn_ended: list[str] = field(default_factory=list)  # multi-turn: for the environment
    next_turns: list[Job] = field(default_factory=list)  # multi-turn: the jobs of next turns
    stale: dict[str, set[tuple[str, int]]] = field(default_factory=dict)  # worker -> to fence
    released: dict[str, list[Job]] = field(default_factory=dict)  # cause -> continuations
    poisoned: list[tuple[str, str]] = field(default_factory=list)  # (request, last worker)
    dropped: list[int] = field(default_factory=list)  # groups quarantined by this read
    tokens_appended: int = 0
    applied: Counter = field(default_factory=Counter)  # Applied value -> delta items
    # worker -> its deltas and releases refused for a wrong grant (it did not read their jobs)
    forged: Counter = field(default_factory=Counter)
    forged_releases: int = 0  # of those, releases (the deltas are `applied["wrong_grant"]`)


def apply_batches(
    table: RequestTable, batches: list[DeltaBatch], rules: CollectRules
) -> CollectOutcome:
    """Apply `batches` in order: each one's deltas first, then its releases (a worker flushes
    a request's tokens before it gives the request back)."""
    out = CollectOutcome()
    tokens_before, quarantined_before = table.tokens_appended, set(table.quarantined)
    stats_before = dict(table.stats)  # `applied` is their difference: no count per delta
    bound = None if rules.max_staleness is None else table.step - rules.max_staleness
    # the loop below runs for every delta of the run: names looked up once
    changed, finished = out.changed.add, out.finished.append
    appended, done, stale = Applied.APPENDED, Applied.FINISHED, Applied.STALE_LEASE
    turn_ended, wrong_grant = Applied.TURN_ENDED, Applied.WRONG_GRANT
    for batch in batches:
        if bound is not None and batch.version < bound:
            _out_of_bound(table, batch, out)
            _release(table, batch, rules, out)
            continue
        for item, applied in zip(
            batch.items, table.apply_all(batch.items, batch.version), strict=True
        ):
            if applied is appended:
                changed(item.request_id)
            elif applied is done:
                changed(item.request_id)
                finished(item.request_id)
            elif applied is stale:
                out.stale.setdefault(batch.worker_id, set()).add((item.request_id, item.lease))
            elif applied is turn_ended:
                changed(item.request_id)
                out.turn_ended.append(item.request_id)
            elif applied is wrong_grant:
                out.forged[batch.worker_id] += 1
        _release(table, batch, rules, out)
    for outcome, n in table.stats.items():
        if n != stats_before[outcome]:
            out.applied[outcome] += n - stats_before[outcome]
    out.tokens_appended = table.tokens_appended - tokens_before
    out.dropped = sorted(table.quarantined - quarantined_before)
    return out


def _out_of_bound(table: RequestTable, batch: DeltaBatch, out: CollectOutcome) -> None:
    """Deltas of a version older than the step's bound: nothing of them is taken; each request
    moves on to a new lease, to continue from its tokens so far on a worker that holds a
    version within the bound (the old lease is fenced at the worker). A worker reads only the
    jobs its version may generate, so this guards the rule rather than runs."""
    for item in batch.items:
        if table.wrong_grant(item.request_id, item.lease, item.grant):
            out.applied[Applied.WRONG_GRANT.value] += 1
            out.forged[batch.worker_id] += 1
            continue
        out.applied[Applied.OUT_OF_BOUND.value] += 1
        job = table.migrate(item.request_id, "bound", True, item.lease)
        if job is not None:
            out.changed.add(item.request_id)
            out.released.setdefault("bound", []).append(job)
            out.stale.setdefault(batch.worker_id, set()).add((item.request_id, item.lease))


def _release(table: RequestTable, batch: DeltaBatch, rules: CollectRules, out: CollectOutcome):
    cause: ReleaseReason = batch.release_reason
    alone = len(batch.released) == 1
    for rel in batch.released:
        if table.wrong_grant(rel.request_id, rel.lease, rel.grant):
            out.forged[batch.worker_id] += 1
            out.forged_releases += 1
            continue
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


def split_by_step(batches: list[DeltaBatch]) -> dict[int, list[DeltaBatch]]:
    """The batches of one read, by the step of their requests (with asynchronous RL a worker's
    flush carries requests of several steps in flight), each step's in read order, a batch's
    deltas still before its releases. A request id that names no step goes under -1."""
    out: dict[int, list[DeltaBatch]] = {}
    for batch in batches:
        # the heads of the request ids ("{step}:..."), each told apart as a step once: this
        # runs for every delta of the run
        heads = {i.request_id.partition(":")[0] for i in batch.items}
        heads |= {r.request_id.partition(":")[0] for r in batch.released}
        if len(heads) <= 1:  # the usual case: the whole batch is one step's
            out.setdefault(step_of(heads.pop()) if heads else -1, []).append(batch)
            continue
        steps = {step_of(head) for head in heads}
        for step in sorted(steps):
            part = msgspec.structs.replace(
                batch,
                items=[i for i in batch.items if step_of(i.request_id) == step],
                released=[r for r in batch.released if step_of(r.request_id) == step],
            )
            out.setdefault(step, []).append(part)
    return out


def split_by_shard(batch: DeltaBatch, shards: int) -> dict[int, DeltaBatch]:
    """A worker's flush as the batches of the shards it names (each request's deltas, then its
    release, to the shard that owns it; one shard: the batch as it is)."""
    if shards == 1:
        return {0: batch}
    items: dict[int, list[DeltaItem]] = {}
    released: dict[int, list[RequestLease]] = {}
    for item in batch.items:
        items.setdefault(shard_of(item.request_id, shards), []).append(item)
    for lease in batch.released:
        released.setdefault(shard_of(lease.request_id, shards), []).append(lease)
    return {
        shard: msgspec.structs.replace(
            batch, items=items.get(shard, []), released=released.get(shard, [])
        )
        for shard in sorted(items.keys() | released.keys())
    }

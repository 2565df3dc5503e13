"""Reclaiming the jobs of a worker that died without notice, as a pure decision: which jobs
stream readers are dead (jobs pending, no heartbeat), and, for the jobs claimed from one of them,
which requests continue where (a continuation job on this shard's table, or a release handed to
the shard that holds the request) and what is counted. No Redis: the step controller's
`on_claimed` decides with it; `coordinator/step/store.py` claims the entries and writes the
decision in one MULTI.
"""

from dataclasses import dataclass, field
from typing import Final, Literal

from services.contracts.consumers import consumer_worker
from services.contracts.messages import DeltaBatch, Job, RequestLease
from services.contracts.shards import shard_of
from services.core.collect import keeps_tokens
from services.core.request_table import RequestTable

CAUSE: Final[Literal["death"]] = "death"


def expired_readers(pending: dict[str, int], alive: set[str]) -> list[str]:
    """The readers of a jobs stream (name -> jobs pending) that hold jobs and whose heartbeat
    expired (not in `alive`), in the order given."""
    return [name for name, n in pending.items() if n > 0 and name not in alive]


@dataclass
class Reclaim:
    """What to do with the jobs claimed from one dead reader."""

    reader: str
    moved: list[Job] = field(default_factory=list)  # continuation jobs, queued on the stream
    handed: dict[int, DeltaBatch] = field(default_factory=dict)  # shard -> its release batch
    dead: bool = True  # a worker declared dead (False: the coordinator's own claimer)

    @property
    def handed_count(self) -> int:
        return sum(len(batch.released) for batch in self.handed.values())


def plan_reclaim(
    table: RequestTable, reader: str, jobs: list[Job], migration: bool, claimer: str
) -> Reclaim:
    """Migrate (in `table`) the requests of the jobs claimed from `reader` under the lease each
    job carried. A request of another shard's table (`contracts.shards`) goes to that shard as
    released by the dead worker (cause `death`): it migrates it as it would the worker's own
    release. Jobs claimed by a coordinator that died before writing its decision are pending
    under `claimer`, which has no heartbeat: they are reclaimed the same way, no worker is
    declared dead."""
    keep = keeps_tokens(migration, CAUSE)
    out = Reclaim(reader, dead=reader != claimer)
    leases: dict[int, list[RequestLease]] = {}
    for job in jobs:
        if job.request_id not in table.requests and table.shards > 1:
            lease = RequestLease(request_id=job.request_id, lease=job.lease, grant=job.grant)
            leases.setdefault(shard_of(job.request_id, table.shards), []).append(lease)
            continue
        new = table.migrate(job.request_id, CAUSE, keep, lease=job.lease)
        if new is not None:
            out.moved.append(new)
    for shard, released in leases.items():
        out.handed[shard] = DeltaBatch(
            worker_id=consumer_worker(reader),
            version=table.step,
            items=[],
            released=released,
            release_reason=CAUSE,
        )
    return out

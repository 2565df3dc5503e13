"""What the read API answers, made from what Redis holds: a run's public record and its metrics
rows, the worker list, a timeline page. Pure: the read model (`read_model`) reads Redis and calls
these; each answer is made once, as the JSON bytes every GET of it then serves.
"""

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.contracts.fleet import fleet_figures
from services.contracts.messages import Heartbeat
from services.contracts.records import RunRecord, WorkerRecord
from services.contracts.runspec import FINAL_STATES, LIVE_STATES, RunSpec
from services.coordinator.schemas import FleetPublic, RunPublic, WorkerPublic
from services.core.call_errors import run_health
from services.infra.read_limit import etag_of
from services.state.step_metrics import StepRow, call_counts, row_dict


@dataclass(frozen=True)
class Doc:
    """One answer: its JSON bytes and their ETag."""

    body: bytes
    etag: str

    @classmethod
    def of(cls, body: bytes) -> "Doc":
        return cls(body, etag_of(body))


@dataclass(frozen=True)
class RunInputs:
    """What a run's answers are made of, as read in one refresh (bytes as Redis gave them)."""

    record: RunRecord  # the run's hash
    version: int | None  # newest committed weight version
    groups_incomplete: int  # the trainer state's count
    rows: tuple[StepRow, ...]  # the per-step metrics rows, by step


def public_record(run_id: str, inputs: RunInputs, spec: RunSpec) -> RunPublic:
    """A run as GET /v1/runs/{id} shows it (infinity, "no limit", as null)."""
    run, rows = inputs.record, inputs.rows
    last = next((row for row in reversed(rows) if row.reward_mean is not None), StepRow())
    n_prem = run.n_prem_recommended
    verdict, errors = run_health([call_counts(row) for row in rows], spec.faults.max_error_share)
    return RunPublic(
        id=run_id,
        state=run.state or "queued",
        spec=spec,
        step=inputs.version or 0,
        steps=spec.training.steps,
        weight_version=inputs.version,
        reward_mean=last.reward_mean,
        tokens_per_s=last.tokens_per_s,
        groups_incomplete=inputs.groups_incomplete,
        t_seed_s=run.t_seed_s,
        n_prem_recommended=None if n_prem is None or math.isinf(n_prem) else n_prem,
        preemptible_wanted=run.preemptible_wanted,
        created_at=run.created_at or 0.0,
        started_at=run.started_at,
        finished_at=run.finished_at,
        error=run.error,
        stall_reason=run.stall_reason if run.state == "stalled" else "",
        stalled_since=run.stalled_since,
        groups_quarantined=run.groups_quarantined,
        reward_errors=sum(row.reward_errors or 0 for row in rows),
        health=verdict.health,
        health_reason=verdict.reason,
        errors=errors,
        max_turns=next((row.max_turns for row in reversed(rows) if row.max_turns), None),
    )


@dataclass(frozen=True)
class RunDocs:
    """The answers of one run, and whether they can still change."""

    public: Doc
    metrics: Doc
    final: bool
    inputs: RunInputs
    spec: RunSpec


FINAL_SETTLE_S = 30.0  # a run finished this long ago gets no more writes (last rows included)


def settled(record: RunRecord, now: float) -> bool:
    """Whether a run's record says it ended more than FINAL_SETTLE_S before `now`."""
    if record.state not in FINAL_STATES or record.finished_at is None:
        return False
    return now - record.finished_at > FINAL_SETTLE_S


def run_docs(run_id: str, inputs: RunInputs, spec: RunSpec, now: float) -> RunDocs:
    """A run's answers; final once the run ended more than FINAL_SETTLE_S before `now` (unix
    seconds): they are not read again."""
    public = public_record(run_id, inputs, spec)
    metrics = {"run_id": run_id, "steps": [row_dict(row) for row in inputs.rows]}
    return RunDocs(
        public=Doc.of(public.model_dump_json().encode()),
        metrics=Doc.of(json.dumps(metrics, separators=(",", ":")).encode()),
        final=settled(inputs.record, now),
        inputs=inputs,
        spec=spec,
    )


def run_list(docs: list[RunDocs]) -> Doc:
    """GET /v1/runs: the runs' public records, newest first."""
    return Doc.of(b"[" + b",".join(d.public.body for d in docs) + b"]")


def fleet_doc(records: list[RunRecord]) -> Doc:
    """GET /v1/fleet from the records of the runs held (newest first): the live ones and the
    pool they want (`contracts.fleet.fleet_figures`)."""
    live = [record for record in records if record.state in LIVE_STATES]
    figures = fleet_figures([record.preemptible_wanted for record in live])
    fleet = FleetPublic(
        runs_active=figures.runs_active,
        preemptible_wanted=figures.preemptible_wanted,
        active_runs=[record.id for record in live],
    )
    return Doc.of(fleet.model_dump_json().encode())


def worker_list(
    records: Mapping[str, WorkerRecord],
    beats: Mapping[str, Heartbeat],
    crashes: Mapping[str, Mapping],
) -> list[WorkerPublic]:
    """GET /v1/workers: every registered worker (by id) with its liveness and last error."""
    out = []
    for worker_id in sorted(records):
        info, beat = records[worker_id], beats.get(worker_id)
        if info.pool is None:  # forgotten meanwhile: no registration left
            continue
        out.append(
            WorkerPublic(
                id=worker_id,
                pool=info.pool,
                engine=info.engine,
                slots=info.slots,
                url=info.url,
                alive=beat is not None,
                run_id=beat.run_id if beat else None,
                version=beat.version if beat else None,
                active=beat.active if beat else 0,
                tokens_generated=beat.tokens_generated if beat else 0,
                last_error=str(crashes.get(worker_id, {}).get("error", ""))
                or (beat.error if beat else ""),
            )
        )
    return out


def worker_docs(workers: list[WorkerPublic]) -> dict[bool | None, Doc]:
    """The worker list as answered for `?alive=` absent, true and false."""

    def doc(items: list[WorkerPublic]) -> Doc:
        return Doc.of(b"[" + b",".join(w.model_dump_json().encode() for w in items) + b"]")

    return {
        None: doc(workers),
        True: doc([w for w in workers if w.alive]),
        False: doc([w for w in workers if not w.alive]),
    }


def entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class Entries:
    """The newest entries of one timeline stream, in order, each as the JSON it is served as;
    at most `cap` of them."""

    cap: int
    keys: list[tuple[int, int]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    last_id: str | None = None

    def extend(self, entries: list[tuple[str, bytes]]) -> None:
        """Append entries read after `last_id` (id, the stream's JSON field)."""
        for entry_id, raw in entries:
            body = json.dumps({"id": entry_id, **json.loads(raw)}, separators=(",", ":"))
            self.keys.append(entry_key(entry_id))
            self.bodies.append(body.encode())
            self.last_id = entry_id
        if len(self.keys) > self.cap:
            del self.keys[: -self.cap], self.bodies[: -self.cap]

    def page(self, after: str | None, count: int) -> list[bytes]:
        """Up to `count` entries after the entry id `after` (from the oldest held when None)."""
        start = 0 if after is None else bisect.bisect_right(self.keys, entry_key(after))
        return self.bodies[start : start + count]


def timeline_body(run_id: str, events: list[bytes], pool: list[bytes]) -> bytes:
    """GET /v1/runs/{id}/timeline from pages of entries."""
    head = json.dumps({"run_id": run_id})[:-1].encode()
    return head + b',"events":[' + b",".join(events) + b'],"pool":[' + b",".join(pool) + b"]}"

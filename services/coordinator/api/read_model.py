"""The control plane's read model: everything the REST API, the dashboard and `spotrl status`
read, refreshed from Redis by one task every `read_refresh_s` and held as the JSON each GET
serves, so that a read costs no Redis round trip and no conversion, whatever the number of
readers. It runs in the control-plane process, never on the data plane's event loop.

A refresh costs three pipelined round trips however many clients read: the run index and the
worker index; the records of the runs that can still change (a finished run's answers are
kept as they are), with the worker records; then the metrics rows that can still change and the
newest entries of the newest runs' timelines. A run's answers are made again only when what
they are made of changed.

It holds at most `max_runs` runs (the newest; older ones are read from Redis when asked for, in
one round trip) and the timelines of the newest `TIMELINE_RUNS`. A read it cannot answer from
a fresh refresh (Redis unreachable at the last one) is a 503, as when Redis is down.

What the read API answers is made here too, from what Redis holds, by pure functions the
model calls (`run_docs`, `run_list`, `worker_list`, `fleet_doc`, `timeline_body`): a run's
public record and its metrics rows, the worker list, a timeline page. Each answer is made once,
as the JSON bytes every GET of it then serves.
"""

import asyncio
import bisect
import contextlib
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError

from services.contracts import keys
from services.contracts.fleet import fleet_figures
from services.contracts.messages import Heartbeat, MalformedMessage
from services.contracts.records import RunRecord, WorkerRecord
from services.contracts.runspec import FINAL_STATES, LIVE_STATES, RunSpec
from services.coordinator.api.schemas import (
    FleetPublic,
    FleetRunPublic,
    RunPublic,
    WorkerPublic,
    WorkerRunPublic,
)
from services.core.call_errors import run_health
from services.infra.read_limit import etag_of
from services.infra.redis_streams import range_entries
from services.infra.retry import brief
from services.state import run_record, timeline, trainer_state, worker_record
from services.state.step_metrics import StepRow, call_counts, from_hash, row_dict

log = logging.getLogger(__name__)
TIMELINE_RUNS = 4  # the newest runs whose timelines are held
REREAD_STEPS = 8  # metrics rows this close to a live run's newest are read again each refresh


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
        paused_at=run.paused_at if run.state not in FINAL_STATES else None,
        owner=run.owner,
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


def fleet_doc(records: list[RunRecord], beats: Mapping[str, Heartbeat] | None = None) -> Doc:
    """GET /v1/fleet from the records of the runs held (newest first) and the workers'
    heartbeats: the live runs, the pool they want (`contracts.fleet.fleet_figures`), and each
    live run's share and the workers serving it now."""
    live = [record for record in records if record.state in LIVE_STATES]
    figures = fleet_figures([record.preemptible_wanted for record in live])
    alive = list((beats or {}).values())
    fleet = FleetPublic(
        runs_active=figures.runs_active,
        preemptible_wanted=figures.preemptible_wanted,
        active_runs=[record.id for record in live],
        runs=[fleet_run(record, serving_beats(alive, record.id)) for record in live],
    )
    return Doc.of(fleet.model_dump_json().encode())


def serving_beats(beats: list[Heartbeat], run_id: str) -> list[Heartbeat]:
    """The beats of the workers serving `run_id`, each as that run reads it."""
    return [v for b in beats if (v := b.serving(run_id)) is not None]


def fleet_run(record: RunRecord, serving: list[Heartbeat]) -> FleetRunPublic:
    """A live run's share (1 where its spec cannot be read) and the workers serving it."""
    try:
        share = record.run_spec().rollout.share
    except ValueError:
        share = 1.0
    return FleetRunPublic(
        id=record.id,
        share=share,
        workers=len(serving),
        slots=sum(b.slots for b in serving),
        active=sum(b.active for b in serving),
    )


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
                runs=runs_served(beat) if beat else {},
                tokens_generated=beat.tokens_generated if beat else 0,
                last_error=str(crashes.get(worker_id, {}).get("error", ""))
                or (beat.error if beat else ""),
            )
        )
    return out


def runs_served(beat: Heartbeat) -> dict[str, WorkerRunPublic]:
    """Each run a worker serves, with its version loaded, requests held and pause."""
    out = {}
    for run_id in beat.served_runs:
        if (view := beat.serving(run_id)) is not None:
            out[run_id] = WorkerRunPublic(
                version=view.version, active=view.active, paused=view.paused
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


class ReadModel:
    def __init__(self, r: aioredis.Redis, refresh_s: float, max_runs: int = 1000) -> None:
        self.r, self.refresh_s, self.max_runs = r, refresh_s, max_runs
        self.runs: dict[str, RunDocs] = {}
        self.order: list[str] = []  # run ids, newest first
        self.workers: dict[bool | None, Doc] = worker_docs([])
        self.fleet: Doc = fleet_doc([])  # the active runs and the pool they want
        self.beats: dict[str, Heartbeat] = {}  # the alive workers' heartbeats, as last read
        self.timelines: dict[str, tuple[Entries, Entries]] = {}
        self.refreshed_at: float | None = None  # clock of the last refresh, if it succeeded
        self.stale_after_s = max(2.0, 8 * refresh_s)
        self.unreadable: set[str] = set()  # runs whose stored spec does not validate (logged)

    async def forever(self) -> None:
        down = False
        while True:
            try:
                await self.refresh()
                if down:
                    log.info("read model: redis is back")
                down = False
            except (RedisError, OSError) as exc:
                self.refreshed_at = None
                if not down:
                    log.warning("read model: redis unavailable (%s); reads answer 503", brief(exc))
                down = True
            await asyncio.sleep(self.refresh_s)

    async def refresh(self) -> None:
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.zrevrange(keys.RUN_INDEX, 0, self.max_runs - 1)
            pipe.smembers(keys.WORKER_INDEX)
            raw_ids, raw_workers = await pipe.execute()
        ids = [x.decode() for x in raw_ids]
        worker_ids = sorted(x.decode() for x in raw_workers)
        changing = [i for i in ids if i not in self.runs or not self.runs[i].final]
        async with self.r.pipeline(transaction=False) as pipe:
            for run_id in changing:
                self._queue_run(pipe, run_id)
            self._queue_workers(pipe, worker_ids)
            replies = await pipe.execute()
        heads = [replies[i * 4 : i * 4 + 4] for i in range(len(changing))]
        worker_replies = replies[len(changing) * 4 :]
        async with self.r.pipeline(transaction=False) as pipe:
            wanted = [
                self._queue_rows(pipe, run_id, head)
                for run_id, head in zip(changing, heads, strict=True)
            ]
            held = ids[:TIMELINE_RUNS]
            for run_id in held:
                self._queue_timeline(pipe, run_id)
            replies = await pipe.execute()
        n_rows = sum(map(len, wanted))
        rows_replies, timeline_replies = replies[:n_rows], replies[n_rows:]
        self._apply_runs(changing, heads, wanted, rows_replies)
        self._apply_timelines(held, timeline_replies)
        self._apply_workers(worker_ids, worker_replies)
        self.order = [i for i in ids if i in self.runs]
        for gone in set(self.runs) - set(self.order):
            del self.runs[gone]
        self.fleet = fleet_doc([self.runs[i].inputs.record for i in self.order], self.beats)
        self.refreshed_at = time.monotonic()

    @property
    def fresh(self) -> bool:
        """Whether the last refresh succeeded, and not longer ago than `stale_after_s` (Redis
        frozen: a refresh that does not come back)."""
        at = self.refreshed_at
        return at is not None and time.monotonic() - at < self.stale_after_s

    @staticmethod
    def _queue_run(pipe: aioredis.client.Pipeline, run_id: str) -> None:
        run_record.queue_read(pipe, run_id)
        pipe.get(keys.run_version(run_id))
        pipe.zrange(keys.run_steps_done(run_id), 0, -1)
        trainer_state.queue_read(pipe, run_id)

    @staticmethod
    def _inputs(run_id: str, head: list, rows: tuple[StepRow, ...]) -> RunInputs | None:
        """What a run's answers are made of, from `_queue_run`'s replies (None: no such run)."""
        record = run_record.from_reply(run_id, head[0])
        if record is None:
            return None
        trained = trainer_state.from_reply(run_id, head[3])
        return RunInputs(
            record=record,
            version=int(head[1]) if head[1] is not None else None,
            groups_incomplete=trained.groups_incomplete if trained else 0,
            rows=rows,
        )

    def _queue_rows(self, pipe: aioredis.client.Pipeline, run_id: str, head: list) -> list[int]:
        """Queue the reads of the rows that may have changed; the steps they are of."""
        steps = sorted(int(s) for s in head[2])
        held = (
            {row.step: row for row in self.runs[run_id].inputs.rows} if run_id in self.runs else {}
        )
        newest = steps[-1] if steps else 0
        wanted = [s for s in steps if s not in held or s > newest - REREAD_STEPS]
        for step in wanted:
            pipe.hgetall(keys.run_step(run_id, step))
        return wanted

    def _apply_runs(
        self, changing: list[str], heads: list[list], wanted: list[list[int]], rows_replies: list
    ) -> None:
        replies = iter(rows_replies)
        for run_id, head, steps in zip(changing, heads, wanted, strict=True):
            fresh_rows = {step: from_hash(next(replies), step) for step in steps}
            old = self.runs.get(run_id)
            held = {row.step: row for row in old.inputs.rows} if old else {}
            all_steps = sorted(int(s) for s in head[2])
            rows = tuple(fresh_rows.get(s) or held.get(s) or StepRow(step=s) for s in all_steps)
            inputs = self._inputs(run_id, head, rows)
            if inputs is None:  # deleted meanwhile
                continue
            if old is not None and old.inputs == inputs:
                if settled(inputs.record, time.time()):
                    self.runs[run_id] = replace(old, final=True)
                continue
            spec = old.spec if old else self._spec(run_id, inputs)
            if spec is None:
                continue
            self.runs[run_id] = run_docs(run_id, inputs, spec, time.time())

    def _spec(self, run_id: str, inputs: RunInputs) -> RunSpec | None:
        """The run's stored spec; None (the run is not shown, said once) for one that no longer
        validates (stored by an older version with other rules): a read never fails on it."""
        try:
            return inputs.record.run_spec()
        except ValidationError as exc:
            if run_id not in self.unreadable:
                self.unreadable.add(run_id)
                log.warning("run %s: its stored spec does not validate, not shown: %s", run_id, exc)
            return None

    @staticmethod
    def _queue_workers(pipe: aioredis.client.Pipeline, worker_ids: list[str]) -> None:
        for worker_id in worker_ids:
            worker_record.queue_read(pipe, worker_id)
        if worker_ids:
            pipe.mget([keys.worker_heartbeat(w) for w in worker_ids])
            pipe.mget([keys.worker_crash(w) for w in worker_ids])

    def _apply_workers(self, worker_ids: list[str], replies: list) -> None:
        if not worker_ids:
            self.workers = worker_docs([])
            self.beats = {}
            return
        n = len(worker_ids)
        records = {
            w: record
            for w, raw in zip(worker_ids, replies[:n], strict=True)
            if (record := worker_record.from_reply(w, raw)) is not None
        }
        beats, crashes = {}, {}
        for worker_id, raw_beat, raw_crash in zip(
            worker_ids, replies[n], replies[n + 1], strict=True
        ):
            if raw_beat is not None:
                with contextlib.suppress(MalformedMessage):
                    beats[worker_id] = Heartbeat.decode(raw_beat)
            if raw_crash is not None:
                try:
                    report = json.loads(raw_crash)
                except ValueError:
                    continue
                if isinstance(report, dict):
                    crashes[worker_id] = report
        self.workers = worker_docs(worker_list(records, beats, crashes))
        self.beats = beats

    def _queue_timeline(self, pipe: aioredis.client.Pipeline, run_id: str) -> None:
        events, pool = self.timelines.get(run_id) or (
            Entries(timeline.EVENTS_MAXLEN),
            Entries(timeline.POOL_MAXLEN),
        )
        self.timelines[run_id] = events, pool
        for stream, held in ((keys.run_events(run_id), events), (keys.run_pool(run_id), pool)):
            start = f"({held.last_id}" if held.last_id else "-"
            pipe.xrange(stream, min=start, max="+", count=timeline.READ_MAX)

    def _apply_timelines(self, held: list[str], replies: list) -> None:
        for i, run_id in enumerate(held):
            for entries, reply in zip(
                self.timelines[run_id], replies[2 * i : 2 * i + 2], strict=True
            ):
                entries.extend(
                    [(eid.decode(), fields[b"e"]) for eid, fields in range_entries(reply)]
                )
        for gone in set(self.timelines) - set(held):
            del self.timelines[gone]

    # ---- reads: what the routes call ----

    def run_list(self, limit: int) -> Doc:
        return run_list([self.runs[i] for i in self.order[:limit]])

    async def run(self, run_id: str) -> RunDocs | None:
        """A run's answers: held, or read now in one round trip (a run older than the held
        ones, or one written a moment ago)."""
        held = self.runs.get(run_id)
        if held is not None:
            return held
        return await self.load(run_id)

    async def load(self, run_id: str, written: bool = False) -> RunDocs | None:
        """Read one run now: a miss, or a run this process has just written (`written`: it is
        held from now on, a new one first in the list)."""
        async with self.r.pipeline(transaction=False) as pipe:
            self._queue_run(pipe, run_id)
            head = await pipe.execute()
        if not head[0]:
            return None
        steps = sorted(int(s) for s in head[2])
        async with self.r.pipeline(transaction=False) as pipe:
            for step in steps:
                pipe.hgetall(keys.run_step(run_id, step))
            raws = await pipe.execute()
        rows = tuple(from_hash(raw, step) for step, raw in zip(steps, raws, strict=True))
        inputs = self._inputs(run_id, head, rows)
        if inputs is None:
            return None
        spec = self._spec(run_id, inputs)
        if spec is None:
            return None
        docs = run_docs(run_id, inputs, spec, time.time())
        if written or run_id in self.runs:
            self.runs[run_id] = docs
            if run_id not in self.order:
                self.order.insert(0, run_id)
        return docs

    async def timeline(
        self, run_id: str, after_event: str | None, after_sample: str | None, count: int
    ) -> bytes:
        held = self.timelines.get(run_id)
        if held is not None:
            events, pool = held
            return timeline_body(
                run_id, events.page(after_event, count), pool.page(after_sample, count)
            )
        async with self.r.pipeline(transaction=False) as pipe:
            for stream, after in (
                (keys.run_events(run_id), after_event),
                (keys.run_pool(run_id), after_sample),
            ):
                pipe.xrange(stream, min=f"({after}" if after else "-", max="+", count=count)
            replies = await pipe.execute()
        pages = []
        for reply in replies:
            page = Entries(count)
            page.extend([(eid.decode(), fields[b"e"]) for eid, fields in range_entries(reply)])
            pages.append(page.bodies)
        return timeline_body(run_id, pages[0], pages[1])

"""The rollout worker: registers with the coordinator, heartbeats, pulls the weights of the
active run's newest version, reads token-level jobs of exactly that version, generates, and
flushes token deltas every few tokens. One asyncio task talks to Redis; one drives the engine.

The engine is driven by the generation task; the jobs task touches it only to load a new
version or drop a run, under `engine_lock`, so a load never lands in the middle of a step.

A task that dies of an error (the engine's, a load's) first writes a crash report (the error,
the requests it was running) and gives those requests back with reason "crash", so that they
migrate at once and the coordinator can tell a request that crashes every worker it runs on.
A job marked `isolate` (it was running in such a crash) runs with nothing beside it.
"""

import asyncio
import contextlib
import json
import logging
import re
import shutil
import time
from collections.abc import Awaitable, Callable

import httpx
import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common import keys, timeline
from services.common.messages import (
    DeltaBatch,
    DeltaItem,
    Heartbeat,
    Job,
    RequestLease,
    WorkerControl,
)
from services.common.redis_streams import (
    decode_or_park,
    park,
    read_group,
    with_reconnect,
)
from services.common.service import auth_headers
from services.common.weights import WeightClient, WeightConflict, WeightTransferError
from services.core.plateau import PlateauEstimator
from services.rollout.engine import Engine, TokenEvent, make_engine
from services.rollout.settings import RolloutSettings

log = logging.getLogger(__name__)
FULL_WAIT_S = 0.05  # a worker with every slot busy re-checks for a new version this often
TOKENS = Counter("spotrl_rollout_tokens_total", "Tokens generated", ["worker", "pool"])
ACTIVE = Gauge("spotrl_rollout_active_requests", "Requests generating")
PULL_S = Histogram(
    "spotrl_rollout_weight_pull_seconds",
    "Weight pull + load time",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
PULL_BYTES = Counter("spotrl_rollout_weight_pull_bytes_total", "Weight bytes pulled")
FLUSHES = Counter("spotrl_rollout_flushes_total", "Delta batches sent")
CRASH_TTL_S = 24 * 3600  # a crash report stays this long
CRASH_REPORT_S = 10.0  # most time spent reporting a crash before the worker goes anyway
ERROR_CHARS = 500  # of an error kept in a crash report


class Pending:
    """Tokens of one request generated since its last flush."""

    def __init__(self, lease: int, offset: int, isolate: bool = False) -> None:
        self.lease, self.offset, self.isolate = lease, offset, isolate
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason = None


class RolloutWorker:
    def __init__(
        self, settings: RolloutSettings, r: aioredis.Redis, engine: Engine | None = None
    ) -> None:
        self.s = settings
        self.r = r
        # `engine`: a backend built elsewhere (benchmarks drive the worker with an instant one)
        self.engine = engine if engine is not None else make_engine(settings)
        self.engine_lock = asyncio.Lock()
        self.slot_freed = asyncio.Event()
        self.weights = WeightClient(settings.weightstore_urls(), settings.api_token)
        self.run_id: str | None = None
        self.version: int | None = None
        self.inbox: asyncio.Queue[tuple[bytes, Job]] = asyncio.Queue()
        self.deferred: list[tuple[bytes, Job]] = []  # read, waiting to run alone or beside none
        self.orders: asyncio.Queue[WorkerControl] = asyncio.Queue()
        self.plateau = PlateauEstimator(settings.slots)
        self.paused_version: int | None = None
        self.control_last_id = b"0-0"
        self.entry_of: dict[str, bytes] = {}  # request id -> job entry id, acked when finished
        self.pending: dict[str, Pending] = {}
        self.tokens_generated = 0
        self.steps_since_flush = 0
        self.last_flush = time.monotonic()
        self.state = "starting"
        self.crashed = ""  # the error a task died of; the worker is on its way out
        self.fault = (
            re.compile(settings.fault_crash_requests) if settings.fault_crash_requests else None
        )

    @property
    def busy(self) -> int:
        return self.engine.active + self.inbox.qsize() + len(self.deferred)

    # ---- registration and heartbeat ----
    async def register(self) -> None:
        body = {
            "id": self.s.worker_id,
            "pool": self.s.pool,
            "engine": self.s.engine,
            "slots": self.s.slots,
            "url": self.s.advertise_url,
        }
        delay = 0.2
        while True:
            try:
                async with httpx.AsyncClient(timeout=10.0) as http:
                    resp = await http.post(
                        f"{self.s.coordinator_url}/v1/workers",
                        json=body,
                        headers=auth_headers(self.s.api_token),
                    )
                if resp.status_code == 201:
                    log.info("registered %s (%s pool)", self.s.worker_id, self.s.pool)
                    return
                raise RuntimeError(f"registration refused: {resp.status_code} {resp.text}")
            except httpx.HTTPError as exc:
                log.warning("coordinator not reachable (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def heartbeat_forever(self) -> None:
        while True:
            beat = Heartbeat(
                worker_id=self.s.worker_id,
                pool=self.s.pool,
                run_id=self.run_id,
                version=self.version,
                active=self.busy,
                slots=self.s.slots,
                tokens_generated=self.tokens_generated,
                plateau=self.plateau.plateau(),
                paused=self.paused_version is not None and self.paused_version == self.version,
                error=self.crashed,
                at=time.time(),
            )
            await with_reconnect(
                lambda b=beat: self.r.set(
                    keys.worker_heartbeat(self.s.worker_id),
                    b.encode(),
                    px=int(self.s.heartbeat_ttl_s * 1000),
                ),
                "heartbeat",
            )
            await asyncio.sleep(self.s.heartbeat_s)

    # ---- jobs ----
    async def jobs_forever(self) -> None:
        await self.register()
        last = await self.r.xrevrange(keys.worker_control(self.s.worker_id), count=1)
        self.control_last_id = last[0][0] if last else b"0-0"  # orders to earlier incarnations
        while True:
            if self.crashed:  # take no more work: the service is going down
                self.state = "crashed"
                await asyncio.sleep(0.1)
                continue
            await self._read_control()
            raw = await with_reconnect(lambda: self.r.get(keys.ACTIVE_RUN), "active run")
            run_id = raw.decode() if raw else None
            if run_id != self.run_id:
                await self._switch_run(run_id)
            if run_id is None:
                self.state = "idle"
                await asyncio.sleep(0.1)
                continue
            raw_v = await self.r.get(keys.run_version(run_id))
            latest = int(raw_v) if raw_v is not None else None
            if latest is None:
                await asyncio.sleep(0.05)
                continue
            if latest != self.version:
                await self._load_version(run_id, latest)
                continue
            if self.paused_version == self.version:  # stepped aside until the next version
                self.state = "paused"
                await asyncio.sleep(0.05)
                continue
            free = min(self.s.slots, self.plateau.plateau()) - self.busy
            if free <= 0:
                # Full: wait for a request to end (or a while, to notice a new version), not
                # poll Redis in a tight loop beside the engine.
                self.slot_freed.clear()
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation
                # that lands as its wait ends, and a killed worker would run on
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(FULL_WAIT_S):
                        await self.slot_freed.wait()
                continue
            self.state = "serving"
            stream = keys.jobs_stream(run_id, self.version)
            entries = await with_reconnect(
                lambda s=stream, n=free: read_group(
                    self.r, s, keys.WORKERS_GROUP, self.s.worker_id, n, 50
                ),
                "read jobs",
            )
            parked: list[tuple[bytes, str]] = []
            for entry in entries:
                job = decode_or_park(Job, entry, parked)
                if job is not None:
                    self.inbox.put_nowait((entry[0], job))
            await park(self.r, keys.parked_stream(run_id), "jobs", parked, entries)
            if parked:
                await self.r.xack(stream, keys.WORKERS_GROUP, *[p[0] for p in parked])

    async def _read_control(self) -> None:
        stream = keys.worker_control(self.s.worker_id)
        reply = await with_reconnect(
            lambda: self.r.xread({stream: self.control_last_id}, count=100), "read control"
        )
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self.control_last_id = entry_id
                order = decode_or_park(WorkerControl, (entry_id, fields), [])
                if order is not None and order.run_id == self.run_id:
                    self.orders.put_nowait(order)

    async def _switch_run(self, run_id: str | None) -> None:
        async with self.engine_lock:
            dropped = self._drop_held()
        if dropped:
            log.info("run changed: dropped %d requests", dropped)
        self.run_id, self.version, self.paused_version = run_id, None, None

    def _drop_held(self) -> int:
        """Forget every request held (a new version or run: they are no longer ours to finish)."""
        dropped = len(self.engine.abort_all())
        while not self.inbox.empty():
            self.inbox.get_nowait()
        self.deferred.clear()
        self.entry_of.clear()
        self.pending.clear()
        return dropped

    async def _load_version(self, run_id: str, version: int) -> None:
        self.state = "loading"
        started = time.monotonic()
        dest = self.s.cache_dir / self.s.worker_id / run_id / f"v{version}"
        # Only the content the trainer announced with the version is ever loaded.
        digest = await self.r.hget(keys.run_digests(run_id), version)
        try:
            if digest is None:
                raise WeightConflict(run_id, version, "was announced without a digest")
            result = await self.weights.pull(run_id, version, dest, expect_digest=digest.decode())
        except WeightConflict as exc:
            log.error("refusing %s v%d: %s; not loading it", run_id, version, exc)
            self.version = None
            await asyncio.sleep(1.0)
            return
        except WeightTransferError as exc:
            # Nothing half-pulled is ever loaded: keep no version and try again.
            log.warning("could not pull %s v%d yet: %s", run_id, version, exc)
            self.version = None
            await asyncio.sleep(1.0)
            return
        async with self.engine_lock:
            # A version is published once the step before it is complete: what is still held
            # was migrated away (or is about to be), never to be finished here.
            self._drop_held()
            await self.engine.load(result.folder)
            self.version = version
        await self.r.sadd(keys.worker_loads(run_id, self.s.worker_id), version)
        PULL_S.observe(time.monotonic() - started)
        PULL_BYTES.inc(result.bytes)
        log.info(
            "loaded %s v%d (%d bytes) in %.2fs",
            run_id,
            version,
            result.bytes,
            time.monotonic() - started,
        )
        if version > 0:
            old = self.s.cache_dir / self.s.worker_id / run_id / f"v{version - 1}"
            await asyncio.to_thread(shutil.rmtree, old, True)

    # ---- generation ----
    async def generate_forever(self) -> None:
        while True:
            while not self.orders.empty():
                await self._obey(self.orders.get_nowait())
            self._admit()
            ACTIVE.set(self.engine.active)
            if self.engine.active == 0:
                await self._flush()
                await asyncio.sleep(0.005)
                continue
            batch, started = self.engine.active, time.perf_counter()
            async with self.engine_lock:
                self._inject_fault()
                events = await self.engine.step()
            delay_ms = self.s.step_delay_ms + self.s.step_delay_per_request_ms * batch
            if delay_ms:
                await asyncio.sleep(delay_ms / 1000)
            self.plateau.record(batch, len(events), time.perf_counter() - started)
            finished = self._record(events)
            self.steps_since_flush += 1
            due = (time.monotonic() - self.last_flush) * 1000 >= self.s.flush_ms
            if finished or due or self.steps_since_flush >= self.s.flush_tokens:
                await self._flush()

    def _admit(self) -> None:
        """Start the jobs read, in order. A job marked `isolate` runs with nothing beside it:
        it waits for the engine to empty, and nothing starts while it runs."""
        waiting = self.deferred + [self.inbox.get_nowait() for _ in range(self.inbox.qsize())]
        self.deferred = []
        for entry_id, job in waiting:
            if job.run_id != self.run_id or job.version != self.version:
                continue
            alone = any(p.isolate and p.finish_reason is None for p in self.pending.values())
            if alone or (job.isolate and self.engine.active):
                self.deferred.append((entry_id, job))
                continue
            self.engine.add(job)
            self.entry_of[job.request_id] = entry_id
            self.pending[job.request_id] = Pending(job.lease, len(job.prefix_ids), job.isolate)

    def _inject_fault(self) -> None:
        """Fault injection for tests (`fault_crash_requests`): a decode step that holds a
        matching request dies of a RuntimeError, as an engine bug would."""
        if self.fault is None:
            return
        for rid, p in self.pending.items():
            if p.finish_reason is None and self.fault.fullmatch(rid):
                raise RuntimeError(f"fault injection: request {rid} crashes this worker")

    def _abort(self, req: RequestLease) -> None:
        """Drop a request whose lease moved on (fencing); its job entry is no longer ours."""
        p = self.pending.get(req.request_id)
        if p is None or p.lease != req.lease:
            return
        self.engine.abort(req.request_id)
        self.pending.pop(req.request_id)
        self.slot_freed.set()
        self.entry_of.pop(req.request_id, None)
        log.info("dropped %s (lease %d): it was migrated", req.request_id, req.lease)

    async def _obey(self, order: WorkerControl) -> None:
        if order.action == "abort":
            for req in order.requests:
                self._abort(req)
        elif order.action == "release":
            await self._release(self._held()[: order.count], "balance")
        elif order.action == "pause" and order.version == self.version:
            self.paused_version = order.version
            await self._release(self._held(), "seed")
            async with self.engine_lock:
                await self.engine.pause()  # free the accelerator for training

    def _held(self) -> list[RequestLease]:
        """Every request this worker holds, those never started first, then by tokens left."""
        held = []
        waiting = self.deferred + [self.inbox.get_nowait() for _ in range(self.inbox.qsize())]
        self.deferred = []
        for entry_id, job in waiting:  # read from the stream but never started
            held.append(RequestLease(request_id=job.request_id, lease=job.lease))
            self.entry_of[job.request_id] = entry_id

        running = [rid for rid, p in self.pending.items() if p.finish_reason is None]
        for rid in sorted(running, key=self.engine.tokens_left, reverse=True):
            held.append(RequestLease(request_id=rid, lease=self.pending[rid].lease))
        return held

    async def _release(self, leases: list[RequestLease], reason: str) -> int:
        """Flush, then give `leases` back to the coordinator, which migrates them."""
        for req in leases:
            self.engine.abort(req.request_id)
        self.slot_freed.set()
        await self._flush(released=leases, reason=reason)
        if leases:
            log.info("released %d requests (%s)", len(leases), reason)
        return len(leases)

    async def release_all(self) -> int:
        """Preemption notice: flush every partial response, give every held request back and
        acknowledge its job, so the coordinator continues them elsewhere at once."""
        return await self._release(self._held(), "preemption")

    async def reporting_crash(
        self, loop: Callable[[], Awaitable[None]], drives_engine: bool = False
    ) -> None:
        """Run one of the worker's tasks; if it dies of an error, report the crash before the
        error goes on to stop the service. Only the task that drives the engine blames the
        requests the engine was running."""
        try:
            await loop()
        except (RedisConnectionError, RedisTimeoutError, OutOfMemoryError):
            raise  # not a crash: the loop starts again once Redis is back (or has room)
        except Exception as exc:
            try:
                await asyncio.wait_for(self._report_crash(exc, drives_engine), CRASH_REPORT_S)
            except Exception:  # the original error matters more; say this one and go on
                log.exception("could not report the crash")
            raise

    async def _report_crash(self, exc: Exception, blame_running: bool) -> None:
        """Write the crash report, then give back what the engine was running (reason "crash"
        when the engine failed) and what it had read but not started (reason "preemption":
        those had no part in the crash)."""
        if self.crashed:
            return  # the other task died first and said so
        self.crashed = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        running = [
            RequestLease(request_id=rid, lease=p.lease)
            for rid, p in self.pending.items()
            if p.finish_reason is None and blame_running
        ]
        report = {
            "at": time.time(),
            "error": self.crashed,
            "run_id": self.run_id,
            "version": self.version,
            "requests": [r.request_id for r in running],
        }
        await self.r.set(keys.worker_crash(self.s.worker_id), json.dumps(report), ex=CRASH_TTL_S)
        log.error("crashed running %d requests: %s", len(running), self.crashed)
        if self.run_id is not None:
            await timeline.emit(
                self.r,
                self.run_id,
                "worker_crashed",
                worker=self.s.worker_id,
                error=self.crashed,
                requests=report["requests"],
            )
        async with self.engine_lock:  # the other task may be in a step
            await self._release(running, "crash")
            await self._release(self._held(), "preemption")

    def _record(self, events: list[TokenEvent]) -> bool:
        finished = False
        for ev in events:
            p = self.pending.get(ev.request_id)
            if p is None:
                continue
            p.tokens.append(ev.token_id)
            p.logprobs.append(ev.logprob)
            if ev.finish_reason is not None:
                p.finish_reason = ev.finish_reason
                finished = True
                self.slot_freed.set()
        self.tokens_generated += len(events)
        TOKENS.labels(self.s.worker_id, self.s.pool).inc(len(events))
        return finished

    async def _flush(
        self, released: list[RequestLease] | None = None, reason: str = "preemption"
    ) -> None:
        self.steps_since_flush = 0
        self.last_flush = time.monotonic()
        items, done = [], []
        for rid, p in self.pending.items():
            if not p.tokens and p.finish_reason is None:
                continue
            items.append(
                DeltaItem(
                    request_id=rid,
                    lease=p.lease,
                    offset=p.offset,
                    token_ids=p.tokens,
                    logprobs=p.logprobs,
                    finished=p.finish_reason is not None,
                    finish_reason=p.finish_reason,
                )
            )
            if p.finish_reason is not None:
                done.append(rid)
            else:
                p.offset += len(p.tokens)
                p.tokens, p.logprobs = [], []
        released = released or []
        if (not items and not released) or self.run_id is None:
            return
        batch = DeltaBatch(
            worker_id=self.s.worker_id,
            version=self.version or 0,
            items=items,
            released=released,
            release_reason=reason,
        )
        done += [r.request_id for r in released]
        run_id = self.run_id
        # NOMKSTREAM: a run that ended took its deltas stream along; a late flush adds nothing
        await with_reconnect(
            lambda: self.r.xadd(keys.deltas_stream(run_id), batch.fields(), nomkstream=True),
            "flush deltas",
        )
        FLUSHES.inc()
        if done:
            stream = keys.jobs_stream(run_id, self.version or 0)
            entry_ids = [self.entry_of.pop(rid) for rid in done if rid in self.entry_of]
            for rid in done:
                self.pending.pop(rid, None)
            if entry_ids:
                await with_reconnect(
                    lambda: self.r.xack(stream, keys.WORKERS_GROUP, *entry_ids), "ack jobs"
                )

    def status(self) -> dict:
        return {
            "worker_id": self.s.worker_id,
            "pool": self.s.pool,
            "state": self.state,
            "run_id": self.run_id,
            "version": self.version,
            "active": self.engine.active,
            "tokens_generated": self.tokens_generated,
        }

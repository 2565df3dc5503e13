"""The rollout manager of one run: for each step, queue B x n token-level jobs on the stream of
the step's weight version, collect token deltas until every group is published to the trainer,
and record the step. A thin asyncio shell that drives the step: reading deltas, scoring and
writing each read's outcome in one MULTI is `delta_collector.py` (decided by
`core.collect.apply_batches`); seeding and balancing `scheduling.py`; the step's metrics row and
the T_seed and N_prem update (`core.seeding.after_step`) `step_record.py`.

It does not train and does not move weights: step s starts when the trainer has committed weight
version s, and the run ends when version `steps` is committed. During a step it watches for a
stall (no worker able to serve the step: `stall_watch.py`) and for poison requests (a request
that crashed `max_request_crashes` workers: its group is dropped, or the run fails).

Redis holds what a restart can still need, no more: a delta entry is deleted in the transaction
that stores what it carried; a step's jobs and request table are deleted once the version
trained on it is committed. No step is queued while Redis is near its memory limit (`memory.py`).
"""

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import Gauge
from tokenizers import Tokenizer

from services.common import keys
from services.common.messages import Heartbeat
from services.common.redis_streams import ensure_group
from services.common.run_state import committed_version, ensure_live
from services.common.runspec import RunSpec
from services.common.tasks import Example, load_task
from services.coordinator.delta_collector import DeltaCollector
from services.coordinator.memory import MemoryGate
from services.coordinator.migration import reclaim_dead_workers
from services.coordinator.scheduling import (
    CAP_TTL_S,
    StepScheduler,
    count_pools,
    heartbeats,
    serving,
)
from services.coordinator.stall_watch import StallWatch
from services.coordinator.step_record import adapt, record_rollout
from services.coordinator.step_store import StepStore
from services.core.balancer import read_cap
from services.core.request_table import RequestTable
from services.core.seeding import PoolSizer, SeedingController, StepTimes

log = logging.getLogger(__name__)
PENDING = Gauge("spotrl_coordinator_requests_pending", "Unfinished requests of the current step")

POLL_S = 0.05
JOBS_TTL_S = 600
CHECK_S = 0.25  # period of the cancel and dead-worker checks


@dataclass(frozen=True)
class StepDone:
    """A finished rollout, as the seeding controller will need it once the step is trained."""

    step: int
    times: StepTimes  # the trainer's part is filled in by `adapt`
    scratch: tuple[str, ...]  # the step's keys, deleted once the next version is committed


def stop_token_ids(model_dir: Path) -> list[int]:
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [int(eos)]


class RunManager:
    def __init__(
        self,
        r: aioredis.Redis,
        run_id: str,
        spec: RunSpec,
        stall_after_s: float = 3.0,
        memory_limit_mb: int = 0,
        memory_high: float = 0.85,
    ) -> None:
        self.r, self.run_id, self.spec = r, run_id, spec
        self.stall = StallWatch(r, run_id, stall_after_s, spec.stall_timeout_s)
        self.memory_gate = MemoryGate(r, run_id, memory_limit_mb, memory_high, CHECK_S)
        model_dir = Path(spec.model)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.stop_ids = stop_token_ids(model_dir)
        self.task = load_task(spec.task, spec.task_path)
        self.collector = DeltaCollector(
            r, run_id, spec, self.memory_gate.runs, self.tokenizer, self.stop_ids, self.task
        )
        self.seeding = SeedingController(
            wait_share=spec.seeding_wait_share, backoff=spec.seeding_backoff
        )
        self.pool = PoolSizer(spec.pool_headroom)

    async def run(self) -> None:
        """Drive every step; returns when version `steps` is committed. Raises RunStopped."""
        await self.collector.start()
        await self.stall.start()
        step = await self._wait_version(0)
        while step < self.spec.steps:
            done = await self._run_step(step)
            step = await self._wait_version(step + 1)
            # no restart can need the step any more: its version is trained and committed
            await self.r.unlink(*done.scratch)
            await adapt(self.r, self.run_id, self.seeding, self.pool, done.step, done.times)

    async def _check_running(self) -> None:
        await ensure_live(self.r, self.run_id)

    async def _wait_version(self, at_least: int) -> int:
        """Wait until the trainer committed a version >= at_least; return it. The trainer is
        at work meanwhile and needs no worker: no stall is looked for."""
        while True:
            await self._check_running()
            version = await committed_version(self.r, self.run_id)
            if version is not None and version >= at_least:
                return version
            await asyncio.sleep(POLL_S * 2)

    async def _run_step(self, step: int) -> StepDone:
        """Queue the step (or resume it after a restart), collect until every group is
        published, record what it took."""
        examples = self.task.examples(self.spec.seed, step, self.spec.prompts_per_step)
        table = self._table(step, examples)
        store = StepStore(self.r, self.run_id, step)
        beats = await heartbeats(self.r)
        began = await self._queue(table, store, beats)
        workers = {w: b for w, b in beats.items() if b.run_id == self.run_id}
        # time of the step so far, on this process's monotonic clock
        started = time.monotonic() - max(0.0, time.time() - began)
        pools = count_pools(workers)
        window = self.seeding.window_s(pools["preemptible"])
        jobs = keys.jobs_stream(self.run_id, step)
        sched = StepScheduler(
            self.r, self.run_id, step, jobs, window, started, fair_reads=self.spec.fair_reads
        )
        await sched.start(workers)
        log.info(
            "step %d: %d jobs on %s (pools %s, T_seed %.2fs)",
            step,
            len(table.requests),
            jobs,
            pools,
            window,
        )
        finished = [rid for rid, req in table.requests.items() if req.done]
        table.score(self.collector.score(table, finished, examples))
        await self._collect_all(table, store, sched, examples)
        await sched.finish()
        await self.stall.resume(step)
        times = StepTimes(
            n_preemptible=pools["preemptible"],
            n_reserved=pools["reserved"],
            started=started,
            seed_end=sched.seed_end,
            rollout_end=time.monotonic(),
            committed=math.nan,  # known once the trainer commits (`adapt`)
            train_compute_s=math.nan,
            train_wait_s=math.nan,
        )
        await record_rollout(self.r, self.run_id, table, times, window, pools)
        # kept until the next version is committed (a restart before then finds the step
        # complete); the TTL covers a coordinator that dies before it deletes them
        await self.r.expire(jobs, JOBS_TTL_S)
        await store.expire_soon(JOBS_TTL_S)
        return StepDone(
            step,
            times,
            (
                *store.scratch_keys(),
                jobs,
                keys.seed_done(self.run_id, step),
                keys.read_cap(self.run_id, step),
            ),
        )

    def _table(self, step: int, examples: list[Example]) -> RequestTable:
        spec = self.spec
        return RequestTable(
            self.run_id,
            step,
            step,
            [self.tokenizer.encode(e.prompt).ids for e in examples],
            spec.group_size,
            spec.max_new_tokens,
            spec.temperature,
            spec.top_p,
            spec.seed,
            [] if spec.ignore_eos else self.stop_ids,
        )

    async def _queue(
        self, table: RequestTable, store: StepStore, beats: dict[str, Heartbeat]
    ) -> float:
        """Queue the step's jobs, or restore a step queued before a restart; when it began.
        With fair reads the step's read cap is set with its jobs, so that the first worker to
        hold the version never reads more than its share."""
        jobs = keys.jobs_stream(self.run_id, table.step)
        began = await store.restore(table)
        if began is None:
            await self.memory_gate.wait_below(self._check_running)  # backpressure
        await ensure_group(self.r, jobs, keys.WORKERS_GROUP)
        if began is None:
            began = time.time()
            async with self.r.pipeline(transaction=True) as pipe:
                if self.spec.fair_reads:
                    n_serving = serving(beats, self.run_id, table.step)
                    cap = read_cap(len(table.requests), n_serving)
                    pipe.set(keys.read_cap(self.run_id, table.step), cap, ex=CAP_TTL_S)
                for job in table.initial_jobs():
                    pipe.xadd(jobs, job.fields())
                store.stage_queued(pipe, began)
                await pipe.execute()
        else:
            log.info(
                "step %d resumed: %d of %d groups already published, %d requests finished",
                table.step,
                len(table.prompts) - len(table.pending_groups),
                len(table.prompts),
                len(table.requests) - len(table.unfinished()),
            )
        return began

    async def _collect_all(
        self, table: RequestTable, store: StepStore, sched: StepScheduler, examples: list[Example]
    ) -> None:
        """Collect until every group is published, checking now and then that the run is
        live, reclaiming dead workers' requests, seeding, balancing and watching for a stall."""
        jobs = keys.jobs_stream(self.run_id, table.step)
        last_check = time.monotonic()
        self.collector.replay()
        while not table.complete:
            await self.collector.collect(table, store, examples, int(POLL_S * 1000))
            PENDING.set(table.unfinished_count)
            if time.monotonic() - last_check > CHECK_S:
                await self._check_running()
                await reclaim_dead_workers(self.r, jobs, table, store, self.spec.migration)
                beats = await heartbeats(self.r)
                await sched.tick(table, beats)
                await self.stall.check(table.step, beats)
                last_check = time.monotonic()

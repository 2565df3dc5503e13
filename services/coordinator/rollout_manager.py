"""The rollout manager of one run: for each step, queue B x n token-level jobs on the stream of
the step's weight version, collect token deltas until every group is published to the trainer,
and record the step. A thin asyncio shell that drives the step: reading deltas, scoring and
writing each read's outcome in one MULTI is `delta_collector.py` (decided by
`core.collect.apply_batches`); seeding and balancing `scheduling.py`; the step's metrics row and
the T_seed and N_prem update (`core.seeding.after_step`) `step_record.py`.

The run's task (its dataset read and checked, `services.tasks`) is loaded when the run starts, off
the event loop, and its reward runner (`reward_runner.py`: reward processes for a reward that may
hang) lives as long as the run.

It does not train and does not move weights: step s starts when the trainer has committed weight
version s, and the run ends when version `steps` is committed. During a step it watches for a
stall (no worker able to serve the step: `stall_watch.py`) and for poison requests (a request
that crashed `max_request_crashes` workers: its group is dropped, or the run fails).

Redis holds what a restart can still need, no more: a delta entry is deleted in the transaction
that stores what it carried; a step's jobs and request table are deleted once the version
trained on it is committed. No step is queued while Redis is near its memory limit (`memory.py`).
"""

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import Gauge
from tokenizers import Tokenizer

from services.contracts import keys
from services.contracts.messages import Heartbeat
from services.contracts.runspec import RunSpec
from services.coordinator.delta_collector import DeltaCollector, LiveStep
from services.coordinator.memory import MemoryGate
from services.coordinator.migration import reclaim_dead_workers
from services.coordinator.reward_runner import open_runner
from services.coordinator.scheduling import (
    CAP_TTL_S,
    StepScheduler,
    count_pools,
    heartbeats,
    serving,
)
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.shard_group import ShardProcesses, ShardView
from services.coordinator.stall_watch import StallWatch
from services.coordinator.step_record import ShardSummary, adapt, record_rollout
from services.coordinator.step_store import StepStore
from services.core.balancer import read_cap
from services.core.request_table import RequestTable
from services.core.seeding import PoolSizer, SeedingController, StepTimes
from services.infra.cancel import cancel_and_wait
from services.infra.redis_streams import ensure_group, with_reconnect
from services.state.run_state import ensure_live, wait_for_version
from services.tasks import DatasetLimits, Task, task_for_spec
from services.tasks.chat import PromptEncoder
from services.tasks.reward_choice import RewardChoice

log = logging.getLogger(__name__)
PENDING = Gauge("spotrl_coordinator_requests_pending", "Unfinished requests of the current step")

POLL_S = 0.05
VERSION_WAIT_MS = 500  # a wait for the next version looks at the run this often
JOBS_TTL_S = 600
CHECK_S = 0.25  # period of the cancel and dead-worker checks


@dataclass(frozen=True)
class StepDone:
    """A finished rollout, as the seeding controller will need it once the step is trained."""

    step: int
    times: StepTimes  # the trainer's part is filled in by `adapt`
    scratch: tuple[str, ...]  # the step's keys, deleted once the next version is committed


@dataclass
class OpenStep:
    """A step queued and live, with its scheduler and what its record needs."""

    live: LiveStep
    sched: StepScheduler | None  # shard 0's only
    started: float  # monotonic
    window: float  # its seeding window
    pools: dict[str, int]

    def times(self, rollout_end: float, seed_end: float | None = None) -> StepTimes:
        """The step's times once its rollout is over; the trainer's are known once it commits
        (`adapt`)."""
        return StepTimes(
            n_preemptible=self.pools["preemptible"],
            n_reserved=self.pools["reserved"],
            started=self.started,
            seed_end=seed_end,
            rollout_end=rollout_end,
            committed=math.nan,
            train_compute_s=math.nan,
            train_wait_s=math.nan,
        )


def stop_token_ids(model_dir: Path) -> list[int]:
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [int(eos)]


class RunManager:
    # set by `run`, which loads them off the event loop
    task: Task
    prompts: PromptEncoder
    collector: DeltaCollector

    def __init__(
        self,
        r: aioredis.Redis,
        run_id: str,
        spec: RunSpec,
        stall_after_s: float = 3.0,
        memory_limit_mb: int = 0,
        memory_high: float = 0.85,
        reward_modules: Sequence[str] = (),
        reward_processes: int = 1,
        limits: DatasetLimits | None = None,
        shard: int = 0,
        shard_processes: "ShardProcesses | None" = None,
    ) -> None:
        """The manager of coordinator shard `shard` of the run (`contracts.shards`): shard 0, the
        coordinator's own, also schedules, reclaims and records, and with more than one shard
        runs the others (`shard_processes`)."""
        self.r, self.run_id, self.spec = r, run_id, spec
        self.shard, self.shards = shard, spec.coordinator_shards
        self.leads = shard == 0
        self.shard_processes = shard_processes
        self.stall = StallWatch(r, run_id, stall_after_s, spec.stall_timeout_s)
        self.memory_gate = MemoryGate(r, run_id, memory_limit_mb, memory_high, CHECK_S)
        self.model_dir = Path(spec.model)
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.stop_ids = stop_token_ids(self.model_dir)
        self.reward_modules, self.reward_processes = reward_modules, reward_processes
        self.limits = limits or DatasetLimits()
        self.seeding = SeedingController(
            wait_share=spec.seeding_wait_share, backoff=spec.seeding_backoff
        )
        self.pool = PoolSizer(spec.pool_headroom)
        self.live: dict[int, LiveStep] = {}  # the steps in flight, by step
        self.committed = 0  # the newest version the trainer committed, as last seen

    @classmethod
    def configured(
        cls,
        r: aioredis.Redis,
        run_id: str,
        spec: RunSpec,
        settings: CoordinatorSettings,
        shard: int = 0,
    ) -> "RunManager":
        """The manager of shard `shard` of the run as the coordinator's settings say; shard 0
        of a run of several shards starts the others."""
        shards = spec.coordinator_shards
        return cls(
            r,
            run_id,
            spec,
            settings.stall_after_s,
            settings.redis_memory_limit_mb,
            settings.redis_memory_high,
            reward_modules=settings.reward_modules,
            reward_processes=settings.reward_processes,
            limits=settings.dataset_limits(),
            shard=shard,
            shard_processes=(
                ShardProcesses(run_id, shards, settings) if shard == 0 and shards > 1 else None
            ),
        )

    def _load(self) -> tuple[Task, PromptEncoder]:
        """The run's task and prompt encoder (blocking: a dataset is read and checked)."""
        spec = self.spec
        # checked at submit too; the allow list may have changed since the run was queued
        RewardChoice.from_spec(spec).check_allowed(self.reward_modules)
        task = task_for_spec(spec, self.limits)
        prompts = PromptEncoder(
            self.model_dir, self.tokenizer, spec.chat_template, spec.system_prompt
        )
        return task, prompts

    async def run(self) -> None:
        """Drive every step; returns when version `steps` is committed. Raises RunStopped."""
        self.task, self.prompts = await asyncio.to_thread(self._load)
        rewards = await open_runner(
            self.task.reward_choice, self.spec.reward_timeout_s, self.reward_processes
        )
        try:
            self.collector = DeltaCollector(
                self.r,
                self.run_id,
                self.spec,
                self.memory_gate.runs,
                self.tokenizer,
                self.stop_ids,
                rewards,
                self.shard,
            )
            async with contextlib.AsyncExitStack() as stack:
                if self.shard_processes is not None:
                    await stack.enter_async_context(self.shard_processes)
                await self._run_steps()
        finally:
            await rewards.close()

    async def _run_steps(self) -> None:
        """Keep the steps in flight that the committed version allows (step s once version
        s - max_staleness is committed), collect their deltas in one task, and retire each
        step once the version trained on it is committed."""
        await self.collector.start()
        if self.leads:
            await self.stall.start()
        k = self.spec.max_staleness
        self.committed = await self._wait_version(0)
        flight: dict[int, asyncio.Task[StepDone]] = {}
        next_step = self.committed
        collecting: asyncio.Task[None] | None = None
        try:
            while self.committed < self.spec.steps:
                while next_step < self.spec.steps and next_step <= self.committed + k:
                    opened = await self._open_step(next_step)
                    flight[next_step] = asyncio.create_task(self._drive_step(opened))
                    next_step += 1
                if collecting is None:  # once the steps of a restart are restored: replay
                    self.collector.replay()
                    collecting = asyncio.create_task(self._collect_forever())
                self.committed = await self._wait_version(self.committed + 1, flight, collecting)
                for step in sorted(s for s in flight if s < self.committed):
                    done = await flight.pop(step)
                    # no restart can need the step any more: its version is trained and committed
                    await self.r.unlink(*done.scratch)
                    if self.leads:
                        await adapt(self.r, self.run_id, self.seeding, self.pool, step, done.times)
        finally:
            # the collector first: no read may be applied (or dropped as a step not in flight)
            # while the steps are torn down; what it read and did not store is replayed later
            await cancel_and_wait([collecting])
            await cancel_and_wait(flight.values())

    async def _collect_forever(self) -> None:
        while True:
            await self.collector.collect(self.live, int(POLL_S * 1000))
            PENDING.set(sum(live.table.unfinished_count for live in self.live.values()))

    async def _check_running(self) -> None:
        await ensure_live(self.r, self.run_id)

    async def _wait_version(
        self,
        at_least: int,
        flight: dict[int, "asyncio.Task[StepDone]"] | None = None,
        collecting: "asyncio.Task[None] | None" = None,
    ) -> int:
        """Wait until the trainer committed a version >= at_least; return it. A step in
        flight or the collector that failed raises here."""
        while True:
            await self._check_running()
            for task in [*(flight or {}).values(), *([collecting] if collecting else [])]:
                if task.done():
                    task.result()  # raises what it died of
            version = await with_reconnect(
                lambda: wait_for_version(self.r, self.run_id, at_least - 1, VERSION_WAIT_MS),
                "committed version",
            )
            if version is not None and version >= at_least:
                return version

    async def _open_step(self, step: int) -> "OpenStep":
        """Queue the step (or restore it after a restart) and, on shard 0, start its scheduler;
        it is live (its deltas are applied) from before its jobs are queued."""
        examples = self.task.examples(self.spec.seed, step, self.spec.prompts_per_step)
        prompt_ids = await asyncio.to_thread(self.prompts.encode, [e.prompt for e in examples])
        table = self._table(step, prompt_ids)
        store = StepStore(self.r, self.run_id, step, self.shard)
        live = LiveStep(table, store, examples)
        beats = await heartbeats(self.r)
        began = await self._queue(live, beats)
        workers = {w: b for w, b in beats.items() if b.run_id == self.run_id}
        # time of the step so far, on this process's monotonic clock
        started = time.monotonic() - max(0.0, time.time() - began)
        pools = count_pools(workers)
        # asynchronous: the reserved pool trains; no seeding window (it is recalled as ever
        # when no preemptible worker is left)
        window = 0.0 if self.spec.max_staleness else self.seeding.window_s(pools["preemptible"])
        jobs = keys.jobs_stream(self.run_id, step)
        sched = None
        if self.leads:
            sched = StepScheduler(
                self.r,
                self.run_id,
                step,
                jobs,
                window,
                started,
                fair_reads=self.spec.fair_reads,
                staleness=self.spec.max_staleness,
            )
            await sched.start(workers)
        log.info(
            "step %d: %d jobs on %s%s (pools %s, T_seed %.2fs)",
            step,
            len(table.requests),
            jobs,
            f" (shard {self.shard} of {self.shards})" if self.shards > 1 else "",
            pools,
            window,
        )
        finished = [rid for rid, req in table.requests.items() if req.done]
        table.score(await self.collector.score(live, finished))
        return OpenStep(live, sched, started, window, pools)

    async def _drive_step(self, step: "OpenStep") -> StepDone:
        """Until every group of the step is published (the collector applies its deltas): on
        shard 0, reclaim dead workers' requests, seed, balance and watch for a stall, then
        record; on another shard, report how many of its requests are unfinished, then its
        summary."""
        live, sched = step.live, step.sched
        table, store = live.table, live.store
        jobs = keys.jobs_stream(self.run_id, table.step)
        others = ShardView(self.r, self.run_id, table.step, self.shards)
        while not (table.complete and (not self.leads or await others.all_done())):
            live.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CHECK_S):
                    await live.changed.wait()
            if table.complete and (not self.leads or await others.all_done()):
                break
            await self._check_running()
            if not self.leads:
                await others.report_unfinished(self.shard, table.unfinished_count)
                continue
            await reclaim_dead_workers(self.r, jobs, table, store, self.spec.migration)
            beats = await heartbeats(self.r)
            assert sched is not None
            await sched.tick(table.unfinished_count + await others.unfinished(table), beats)
            if table.step == min(self.live):  # the step the trainer waits for
                await self.stall.check(min(table.step, self.committed), beats)
        # complete: its last deltas are applied and stored; later ones of it are dropped
        self.live.pop(table.step, None)
        summary = ShardSummary.of(table, live.reward_errors)
        await store.expire_soon(JOBS_TTL_S)
        if not self.leads:
            await others.report_done(self.shard, summary)
            return StepDone(table.step, step.times(time.monotonic()), tuple(store.scratch_keys()))
        assert sched is not None
        await sched.finish()
        await self.stall.resume(table.step)
        times = step.times(time.monotonic(), sched.seed_end)
        total = ShardSummary.total([summary, *(await others.summaries())])
        await record_rollout(
            self.r, self.run_id, table.step, table.version, total, times, step.window, step.pools
        )
        # kept until the next version is committed (a restart before then finds the step
        # complete); the TTL covers a coordinator that dies before it deletes them
        await self.r.expire(jobs, JOBS_TTL_S)
        await others.expire(JOBS_TTL_S)
        return StepDone(
            table.step,
            times,
            (
                *store.scratch_keys(),
                jobs,
                keys.seed_done(self.run_id, table.step),
                keys.read_cap(self.run_id, table.step),
                keys.step_shards(self.run_id, table.step),
            ),
        )

    def _table(self, step: int, prompt_ids: list[list[int]]) -> RequestTable:
        spec = self.spec
        return RequestTable(
            self.run_id,
            step,
            step,
            prompt_ids,
            spec.group_size,
            spec.max_new_tokens,
            spec.temperature,
            spec.top_p,
            spec.seed,
            [] if spec.ignore_eos else self.stop_ids,
            top_k=spec.top_k,
            repetition_penalty=spec.repetition_penalty,
            shard=self.shard,
            shards=self.shards,
        )

    async def _queue(self, live: LiveStep, beats: dict[str, Heartbeat]) -> float:
        """Queue the step's jobs (this shard's), or restore a step queued before a restart; when
        it began. The step is live (in `self.live`) before its jobs are queued. With fair reads
        shard 0 sets the step's read cap with its jobs, so that the first worker to hold the
        version never reads more than its share."""
        table, store = live.table, live.store
        jobs = keys.jobs_stream(self.run_id, table.step)
        began = await store.restore(table)
        if began is None:
            await self.memory_gate.wait_below(self._check_running)  # backpressure
        await ensure_group(self.r, jobs, keys.WORKERS_GROUP)
        self.live[table.step] = live
        if began is None:
            began = time.time()
            async with self.r.pipeline(transaction=True) as pipe:
                if self.spec.fair_reads and self.leads:
                    n_serving = serving(beats, self.run_id, table.step)
                    step_requests = len(table.prompts) * table.group_size  # every shard's
                    cap = read_cap(step_requests, n_serving)
                    pipe.set(keys.read_cap(self.run_id, table.step), cap, ex=CAP_TTL_S)
                for job in table.initial_jobs():
                    pipe.xadd(jobs, job.fields())
                store.stage_queued(pipe, began)
                await pipe.execute()
        else:
            log.info(
                "step %d resumed: %d of %d groups already published, %d requests finished",
                table.step,
                table.groups - len(table.pending_groups),
                table.groups,
                len(table.requests) - len(table.unfinished()),
            )
        return began

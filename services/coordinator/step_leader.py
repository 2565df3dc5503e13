"""The step's leader: coordinator shard 0 of a run, the coordinator's own. Besides its share of
every step (`step_shard.py`), it does what is the whole step's: the seeding window and the
balancing (`scheduling.StepScheduler`, given every shard's unfinished requests), the fair-reads
cap queued with the jobs, reclaiming dead workers' jobs (`migration.py`), the stall watch
(`stall_watch.py`), the step's metrics row once every shard's groups are published (then the
verdict on the step's failed calls of user code, `core.call_errors`: too many fail the run) and the
T_seed and N_prem update once the trainer committed (`step_record.py`). With several shards it
runs the others as child processes (`shard_group.ShardProcesses`).

It trains nothing and moves no weights: step s starts when the trainer has committed version s.
"""

import contextlib
import time
from collections.abc import Sequence

import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.messages import Heartbeat
from services.contracts.runspec import RunSpec
from services.coordinator.migration import reclaim_dead_workers
from services.coordinator.open_step import OpenStep, StepDone
from services.coordinator.run.runs import RunFailed
from services.coordinator.scheduling import CAP_TTL_S, StepScheduler, heartbeats
from services.coordinator.settings import EnvironmentLimits
from services.coordinator.shard_group import ShardProcesses, ShardView
from services.coordinator.stall_watch import StallWatch
from services.coordinator.step_record import ShardSummary, adapt, record_rollout
from services.coordinator.step_shard import JOBS_TTL_S, StepShard
from services.core.balancer import read_cap
from services.core.call_errors import judge
from services.core.request_table import RequestTable
from services.core.seeding import PoolSizer, SeedingController
from services.core.step_controller import serving
from services.tasks import DatasetLimits


class StepLeader(StepShard):
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
        shard_processes: ShardProcesses | None = None,
        environments: EnvironmentLimits | None = None,
    ) -> None:
        """Shard 0 of the run; with more than one shard it runs the others
        (`shard_processes`)."""
        super().__init__(
            r,
            run_id,
            spec,
            memory_limit_mb,
            memory_high,
            reward_modules,
            reward_processes,
            limits,
            shard=0,
            environments=environments,
        )
        self.shard_processes = shard_processes
        self.stall = StallWatch(r, run_id, stall_after_s, spec.faults.stall_timeout_s)
        self.seeding = SeedingController(
            wait_share=spec.rollout.seeding_wait_share, backoff=spec.rollout.seeding_backoff
        )
        self.pool = PoolSizer(spec.rollout.pool_headroom)
        self.scheds: dict[int, StepScheduler] = {}  # each step's in flight

    async def _enter(self, stack: contextlib.AsyncExitStack) -> None:
        if self.shard_processes is not None:
            await stack.enter_async_context(self.shard_processes)

    async def _started(self) -> None:
        await self.stall.start()

    async def _retired(self, step: int, done: StepDone) -> None:
        await adapt(self.r, self.run_id, self.seeding, self.pool, step, done.times)

    def _window(self, pools: dict[str, int]) -> float:
        # asynchronous: the reserved pool trains; no seeding window (it is recalled as ever
        # when no preemptible worker is left)
        return (
            0.0 if self.spec.rollout.max_staleness else self.seeding.window_s(pools["preemptible"])
        )

    def _stage_read_cap(self, pipe, table: RequestTable, beats: dict[str, Heartbeat]) -> None:
        """With fair reads the step's read cap goes with its jobs, so that the first worker to
        hold the version never reads more than its share."""
        if self.spec.rollout.fair_reads:
            n_serving = serving(beats, self.run_id, table.step)
            step_requests = len(table.prompts) * table.group_size  # every shard's
            cap = read_cap(step_requests, n_serving)
            pipe.set(keys.read_cap(self.run_id, table.step), cap, ex=CAP_TTL_S)

    async def _opened(self, step: OpenStep) -> None:
        n = step.live.table.step
        sched = StepScheduler(self.r, step.live.control, keys.jobs_stream(self.run_id, n))
        await sched.start(step.workers, step.window, step.started)
        self.scheds[n] = sched

    async def _drive_step(self, step: OpenStep) -> StepDone:
        """Until every shard's groups of the step are published: reclaim dead workers'
        requests, seed, balance and watch for a stall; then record the step."""
        table, store = step.live.table, step.live.store
        sched = self.scheds[table.step]
        jobs = keys.jobs_stream(self.run_id, table.step)
        others = ShardView(self.r, self.run_id, table.step, self.shards)
        while not await self._until_change(step.live, others, all_shards=True):
            await reclaim_dead_workers(
                self.r, jobs, table, store, self.spec.rollout.migration, self.worker_keys
            )
            beats = await heartbeats(self.r)
            await sched.tick(table.unfinished_count + await others.unfinished(table), beats)
            if table.step == min(self.live):  # the step the trainer waits for
                await self.stall.check(min(table.step, self.committed), beats)
        # complete: its last deltas are applied and stored; later ones of it are dropped
        self.live.pop(table.step, None)
        self.scheds.pop(table.step, None)
        summary = step.live.summary()
        await store.expire_soon(JOBS_TTL_S)
        await sched.finish()
        await self.stall.resume(table.step)
        times = step.times(time.monotonic(), sched.seed_end)
        total = ShardSummary.total([summary, *(await others.summaries())])
        await record_rollout(
            self.r, self.run_id, table.step, table.step, total, times, step.window, step.pools
        )
        # the whole step's failures of user code, every shard's: too many fail the run
        verdict = judge(
            total.call_counts(), self.spec.faults.max_error_share, f"in step {table.step}"
        )
        if verdict.health == "failed":
            raise RunFailed(verdict.reason)
        # kept until the next version is committed (a restart before then finds the step
        # complete); the TTL covers a coordinator that dies before it deletes them
        await self.r.expire(jobs, JOBS_TTL_S)
        await others.expire(JOBS_TTL_S)
        scratch = (
            *store.scratch_keys(),
            jobs,
            keys.seed_done(self.run_id, table.step),
            keys.read_cap(self.run_id, table.step),
            keys.step_shards(self.run_id, table.step),
        )
        return StepDone(table.step, times, scratch)

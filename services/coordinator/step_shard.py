"""What every coordinator shard of a run does for each step, the leader (shard 0,
`step_leader.py`) and the followers (shards 1..K-1, `step_follower.py`) alike: keep the steps in
flight that the committed version allows, queue this shard's jobs of each (or restore a step
queued before a restart), collect this shard's token deltas into the steps' request tables
(`delta_collector.py`, which publishes the groups), and retire a step once the version trained on
it is committed.

What only one of them does is a hook: the leader seeds, balances, reclaims, watches for a stall
and records the step; a follower reports its part of the step to the leader (`ShardView`).

The run's task (its dataset read and checked, `services.tasks`) is loaded when the run starts, off
the event loop, and its reward runner (`reward_runner.py`: reward processes for a reward that may
hang) lives as long as the run. No step is queued while Redis is near its memory limit
(`run/memory.py`).
"""

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import Gauge
from tokenizers import Tokenizer

from services.contracts import keys
from services.contracts.messages import Heartbeat
from services.contracts.runspec import RunSpec
from services.coordinator.delta_collector import DeltaCollector, LiveStep
from services.coordinator.episode_shell import EpisodeShell, open_environment
from services.coordinator.open_step import OpenStep, StepDone, stop_token_ids
from services.coordinator.reward_runner import open_runner
from services.coordinator.run.memory import MemoryGate
from services.coordinator.scheduling import count_pools, heartbeats
from services.coordinator.settings import EnvironmentLimits
from services.coordinator.shard_group import ShardView
from services.coordinator.step_store import StepStore
from services.coordinator.workers.keys import WorkerKeys
from services.core.collect import CollectRules
from services.core.episodes import EpisodeTable
from services.core.request_table import RequestTable
from services.core.step_controller import StepController
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


class StepShard(abc.ABC):
    """The shard `shard` of a run's steps (`contracts.shards`); subclassed by the leader and the
    follower, which fill in the hooks."""

    # with `worker_redis_users` on, the workers' signing keys: a delta batch is applied only
    # when signed by the worker it names (set by `RunManager.configured`)
    worker_keys: WorkerKeys | None = None
    # set by `run`, which loads them off the event loop
    task: Task
    prompts: PromptEncoder
    collector: DeltaCollector

    def __init__(
        self,
        r: aioredis.Redis,
        run_id: str,
        spec: RunSpec,
        memory_limit_mb: int = 0,
        memory_high: float = 0.85,
        reward_modules: Sequence[str] = (),
        reward_processes: int = 1,
        limits: DatasetLimits | None = None,
        shard: int = 0,
        environments: EnvironmentLimits | None = None,
    ) -> None:
        self.r, self.run_id, self.spec = r, run_id, spec
        self.environments = environments or EnvironmentLimits()
        self.episodes: EpisodeShell | None = None  # a run with an environment
        self.shard, self.shards = shard, spec.rollout.coordinator_shards
        self.memory_gate = MemoryGate(r, run_id, memory_limit_mb, memory_high, CHECK_S)
        self.model_dir = Path(spec.model)
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.stop_ids = stop_token_ids(self.model_dir)
        self.reward_modules, self.reward_processes = reward_modules, reward_processes
        self.limits = limits or DatasetLimits()
        self.live: dict[int, LiveStep] = {}  # the steps in flight, by step
        self.committed = 0  # the newest version the trainer committed, as last seen

    # -- hooks ------------------------------------------------------------------------------

    async def _enter(self, stack: contextlib.AsyncExitStack) -> None:
        """What lives as long as the run's steps (the leader: the other shards)."""
        return None  # a hook: nothing by default

    async def _started(self) -> None:
        """The collector is ready, before the first step (the leader: its stall watch)."""
        return None  # a hook: nothing by default

    async def _retired(self, step: int, done: StepDone) -> None:
        """The version trained on `step` is committed."""
        return None  # a hook: nothing by default

    def _window(self, pools: dict[str, int]) -> float:
        """The seeding window of a step opened with these pools."""
        return 0.0

    def _stage_read_cap(self, pipe, table: RequestTable, beats: dict[str, Heartbeat]) -> None:
        """Anything to queue with the step's jobs (the leader: the fair-reads cap)."""
        return None  # a hook: nothing by default

    async def _opened(self, step: OpenStep) -> None:
        """The step is queued and live."""
        return None  # a hook: nothing by default

    @abc.abstractmethod
    async def _drive_step(self, step: OpenStep) -> StepDone:
        """Run the step until this shard's part of it is done (leader: the whole step's)."""

    # -- the steps --------------------------------------------------------------------------

    def _load(self, tools: list[dict] | None) -> tuple[Task, PromptEncoder]:
        """The run's task and prompt encoder (blocking: a dataset is read and checked)."""
        spec = self.spec
        # checked at submit too; the allow list may have changed since the run was queued
        RewardChoice.from_spec(spec).check_allowed(self.reward_modules)
        task = task_for_spec(spec, self.limits)
        data = spec.data
        prompts = PromptEncoder(
            self.model_dir, self.tokenizer, data.chat_template, data.system_prompt, tools
        )
        return task, prompts

    async def run(self) -> None:
        """Drive every step; returns when version `steps` is committed. Raises RunStopped."""
        env = await open_environment(self.spec, self.environments)
        try:
            tools = env.tools if env is not None else None
            self.task, self.prompts = await asyncio.to_thread(self._load, tools)
            if env is not None:
                self.episodes = EpisodeShell(
                    env, self.spec, self.prompts, self.tokenizer, self.stop_ids
                )
            await self._run_with_rewards()
        finally:
            if env is not None:
                await env.close()

    async def _run_with_rewards(self) -> None:
        rewards = await open_runner(
            self.task.reward_choice, self.spec.scoring.reward_timeout_s, self.reward_processes
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
                self.episodes,
                self.worker_keys,
            )
            async with contextlib.AsyncExitStack() as stack:
                await self._enter(stack)
                await self.collector.start()
                await self._started()
                await self._run_steps()
        finally:
            await rewards.close()

    async def _run_steps(self) -> None:
        """Keep the steps in flight that the committed version allows (step s once version
        s - max_staleness is committed), collect their deltas in one task, and retire each
        step once the version trained on it is committed."""
        k = self.spec.rollout.max_staleness
        self.committed = await self._wait_version(0)
        flight: dict[int, asyncio.Task[StepDone]] = {}
        next_step = self.committed
        collecting: asyncio.Task[None] | None = None
        try:
            while self.committed < self.spec.training.steps:
                while next_step < self.spec.training.steps and next_step <= self.committed + k:
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
                    await self._retired(step, done)
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

    async def _open_step(self, step: int) -> OpenStep:
        """Queue the step (or restore it after a restart); it is live (its deltas are applied)
        from before its jobs are queued."""
        examples = self.task.examples(self.spec.seed, step, self.spec.training.prompts_per_step)
        texts = [e.prompt for e in examples]
        if self.episodes is not None:  # each episode's opening, from the environment
            texts = await self.episodes.openings(examples)
        prompt_ids = await asyncio.to_thread(self.prompts.encode, texts)
        table = self._table(step, prompt_ids)
        store = StepStore(self.r, self.run_id, step, self.shard)
        live = LiveStep(self._controller(table), store, examples)
        beats = await heartbeats(self.r)
        began = await self._queue(live, beats)
        workers = {w: b for w, b in beats.items() if b.run_id == self.run_id}
        # time of the step so far, on this process's monotonic clock
        started = time.monotonic() - max(0.0, time.time() - began)
        pools = count_pools(workers)
        opened = OpenStep(live, started, self._window(pools), pools, workers)
        await self._opened(opened)
        log.info(
            "step %d: %d jobs on %s%s (pools %s, T_seed %.2fs)",
            step,
            len(table.requests),
            keys.jobs_stream(self.run_id, step),
            f" (shard {self.shard} of {self.shards})" if self.shards > 1 else "",
            pools,
            opened.window,
        )
        if self.episodes is not None:  # finished episodes hold their rewards
            await self.collector.resume_turns(live)
            return opened
        finished = [rid for rid, req in table.requests.items() if req.done]
        table.score(await self.collector.score(live, finished))
        return opened

    async def _until_change(self, live: LiveStep, others: ShardView, all_shards: bool) -> bool:
        """Wait for the step's table to change or CHECK_S to pass; whether the step is complete
        (with `all_shards`, every shard's part of it). Raises RunStopped."""
        table = live.table
        if table.complete and (not all_shards or await others.all_done()):
            return True
        live.changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CHECK_S):
                await live.changed.wait()
        if table.complete and (not all_shards or await others.all_done()):
            return True
        await self._check_running()
        return False

    def _table(self, step: int, prompt_ids: list[list[int]]) -> RequestTable:
        """The step's request table (of episodes, in a run with an environment)."""
        spec = self.spec
        stops = [] if spec.sampling.ignore_eos else self.stop_ids
        args = (self.run_id, step, prompt_ids, spec.training.group_size, spec.sampling)
        if self.episodes is not None:
            turns = self.episodes.max_turns
            return EpisodeTable(
                *args, spec.seed, stops, shard=self.shard, shards=self.shards, max_turns=turns
            )
        return RequestTable(*args, spec.seed, stops, shard=self.shard, shards=self.shards)

    def _controller(self, table: RequestTable) -> StepController:
        """The step's controller, with the run's rules for moving requests and for reads."""
        spec = self.spec
        rules = CollectRules.for_run(spec)
        return StepController(table, rules, spec.rollout.fair_reads, spec.rollout.max_staleness)

    async def _queue(self, live: LiveStep, beats: dict[str, Heartbeat]) -> float:
        """Queue the step's jobs (this shard's), or restore a step queued before a restart; when
        it began. The step is live (in `self.live`) before its jobs are queued."""
        table, store = live.table, live.store
        jobs = keys.jobs_stream(self.run_id, table.step)
        began = await store.restore(table)
        if began is None:
            await self.memory_gate.wait_below(self._check_running)  # backpressure
        await ensure_group(self.r, jobs, keys.WORKERS_GROUP)
        self.live[table.step] = live
        if began is not None:
            log.info(
                "step %d resumed: %d of %d groups already published, %d requests finished",
                table.step,
                table.groups - len(table.pending_groups),
                table.groups,
                len(table.requests) - len(table.unfinished()),
            )
            return began
        began = time.time()
        async with self.r.pipeline(transaction=True) as pipe:
            self._stage_read_cap(pipe, table, beats)
            for job in table.initial_jobs():
                pipe.xadd(jobs, job.fields())
            store.stage_queued(pipe, table, began)
            await pipe.execute()
        return began

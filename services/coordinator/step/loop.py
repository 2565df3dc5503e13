"""The step loop of one coordinator shard of a run: for each step, queue this shard's B x n / K
token-level jobs (or restore a step queued before a restart), collect its token deltas until
every group is published to the trainer, and retire the step once the version trained on it
is committed. It keeps the steps in flight that the committed version allows (step s once
version s - max_staleness is committed).

Each step's decisions are its `StepController`'s (`core.step_controller`): every event goes in
(open, a read of deltas, scores, environment answers, a tick, the jobs claimed from a dead
reader, the end) and one `Effects` value comes out, which this shell writes
(`step/store.py`: one MULTI where it is one decision) and tells. The shell decides nothing.

Shard 0 leads: its loop holds a `Leadership` (`step/leadership.py`; None on the followers,
shards 1..K-1, child processes it runs: `run.shard.ShardProcesses`), which ticks each step's
controller with every shard's unfinished requests (`step.store.ShardView`), claims the jobs of
dead workers, writes stall state changes, records the step once every shard's groups are
published (then fails the run on too many failed calls of user code), and after the trainer
committed a step, writes the seeding update (`step.record.adapt`). A follower reports its part
of each step to the leader through `ShardView`.

The run's task (`services.tasks`) is loaded off the event loop when the run starts; its reward
runner (`scoring/rewards.py`) lives as long as the run. No step is queued while Redis is near its
memory limit (`step/memory.py`). Redis holds what a restart can still need, no more: a step's jobs
and request table are deleted once the version trained on it is committed.
"""

import asyncio
import contextlib
import json
import logging
import math
import time
from functools import partial
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import Gauge
from tokenizers import Tokenizer

from services.contracts import keys
from services.contracts.runspec import RunSpec
from services.coordinator.scoring.episodes import EpisodeShell, open_environment
from services.coordinator.scoring.rewards import open_runner
from services.coordinator.settings import CoordinatorSettings, EnvironmentLimits
from services.coordinator.step.deltas import DeltaCollector, LiveStep
from services.coordinator.step.history import DraftHistory
from services.coordinator.step.leadership import JOBS_TTL_S, Leadership, StepDone
from services.coordinator.step.memory import MemoryGate
from services.coordinator.step.store import ShardView, StepStore
from services.coordinator.workers.fleet import (
    heartbeats,
)
from services.coordinator.workers.keys import WorkerKeys
from services.core.collect import CollectRules
from services.core.episodes import EpisodeTable
from services.core.request_table import RequestTable
from services.core.step_controller import StepController
from services.infra.cancel import cancel_and_wait
from services.infra.redis_failover import primary_of
from services.infra.redis_streams import ensure_group, with_reconnect
from services.state import run_record, timeline
from services.state.run_state import ensure_live, wait_for_version
from services.tasks import DatasetLimits, Task, task_for_spec
from services.tasks.chat import PromptEncoder
from services.tasks.reward_choice import RewardChoice

log = logging.getLogger(__name__)
PENDING = Gauge("spotrl_coordinator_requests_pending", "Unfinished requests of the current step")
T_SEED = Gauge("spotrl_coordinator_t_seed_seconds", "Seeding window of the current step")

POLL_S = 0.05
VERSION_WAIT_MS = 500  # a wait for the next version looks at the run this often
CHECK_S = 0.25  # period of the cancel and dead-worker checks


def stop_token_ids(model_dir: Path) -> list[int]:
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [int(eos)]


def build_loop(
    r: aioredis.Redis,
    run_id: str,
    spec: RunSpec,
    settings: CoordinatorSettings,
    shard: int = 0,
) -> "StepLoop":
    """The step loop of shard `shard` of the run as the coordinator's settings say: shard 0
    leads, another follows (the other shards' processes are the run's: `run.shard.drive`)."""
    lead = Leadership(r, run_id, spec, settings.stall_after_s) if shard == 0 else None
    return StepLoop(
        r,
        run_id,
        spec,
        settings.redis_memory_limit_mb,
        settings.redis_memory_high,
        reward_modules=settings.reward_modules,
        reward_processes=settings.reward_processes,
        limits=settings.dataset_limits(),
        shard=shard,
        environments=settings.environment_limits(),
        lead=lead,
        # with `worker_redis_users` on, workers sign their deltas: a batch is applied only
        # when signed by the worker it names
        worker_keys=WorkerKeys(r) if settings.worker_redis_users else None,
    )


class StepLoop:
    """Shard `shard` of a run's steps (`contracts.shards`); the leader's loop holds a
    `Leadership`, a follower's none."""

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
        reward_modules: tuple[str, ...] | list[str] = (),
        reward_processes: int = 1,
        limits: DatasetLimits | None = None,
        shard: int = 0,
        environments: EnvironmentLimits | None = None,
        lead: Leadership | None = None,
        worker_keys: WorkerKeys | None = None,
    ) -> None:
        self.r, self.run_id, self.spec = r, run_id, spec
        self.lead, self.worker_keys = lead, worker_keys
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
        # the responses kept by prompt, for drafts and length-aware dispatch (None: both off)
        on = spec.rollout.drafts != "off" or spec.rollout.length_aware
        self.history = DraftHistory(r, run_id) if on else None
        self.committed = 0  # the newest version the trainer committed, as last seen

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
            await self.collector.start()
            if self.lead is not None:
                await self.lead.start()
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
                    live = await self._open_step(next_step)
                    flight[next_step] = asyncio.create_task(self._drive(live))
                    next_step += 1
                if collecting is None:  # once the steps of a restart are restored: replay
                    self.collector.replay()
                    collecting = asyncio.create_task(self._collect_forever())
                self.committed = await self._wait_version(self.committed + 1, flight, collecting)
                for step in sorted(s for s in flight if s < self.committed):
                    done = await flight.pop(step)
                    # no restart can need the step any more: its version is trained and committed
                    await self.r.unlink(*done.scratch)
                    if self.lead is not None:
                        await self.lead.retired(done)
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

    async def _open_step(self, step: int) -> LiveStep:
        """Queue the step (or restore it after a restart): the controller's open, written
        (`DeltaCollector.settle`: a restored step's finished responses scored, its turns
        answered). It is live (its deltas are applied) from before its jobs are queued."""
        examples = self.task.examples(self.spec.seed, step, self.spec.training.prompts_per_step)
        texts = [e.prompt for e in examples]
        if self.episodes is not None:  # each episode's opening, from the environment
            texts = await self.episodes.openings(examples)
        prompt_ids = await asyncio.to_thread(self.prompts.encode, texts)
        history = self.history and await self.history.read(prompt_ids, self.shard, self.shards)
        table = self._table(step, prompt_ids, history or {})
        store = StepStore(self.r, self.run_id, step, self.shard, self.history)
        live = LiveStep(self._controller(table), store, examples)
        began = await live.store.restore(table)
        if began is None:
            await self.memory_gate.wait_below(self._check_running)  # backpressure
            await self._wait_resumed(step)
        beats = await heartbeats(self.r)
        await ensure_group(self.r, live.store.jobs, keys.WORKERS_GROUP)
        self.live[step] = live
        if began is not None:
            log.info(
                "step %d resumed: %d of %d groups already published, %d requests finished",
                step,
                table.groups - len(table.pending_groups),
                table.groups,
                len(table.requests) - len(table.unfinished()),
            )
        seed_done = self.lead is not None and bool(
            await self.r.exists(keys.seed_done(self.run_id, step))
        )
        queued_at = time.time() if began is None else None
        # time of the step so far, on this process's monotonic clock
        started = time.monotonic() - max(0.0, time.time() - (began or queued_at or 0.0))
        # the primary this loop writes on (its fence: `run.shard.drive`) and, for a step
        # restored, the one its state was written on
        primary, written_on = primary_of(self.r) or "", live.store.written_on
        effects = live.control.open(
            beats, started, time.monotonic(), queued_at, seed_done, primary, written_on
        )
        if effects.migrated.get("failover"):
            log.warning(
                "step %d: restored from redis primary %s, written on %s: %d requests move on "
                "from the tokens it holds",
                live.table.step,
                primary or "(plain url)",
                written_on or "(plain url)",
                effects.migrated["failover"],
            )
        await self.collector.settle([(live, effects)])
        self._say_opened(live.control)
        return live

    async def _wait_resumed(self, step: int) -> None:
        """Before a new step: wait while an operator has the run paused (`RunStore.pause`);
        the steps in flight went on meanwhile. Raises RunStopped when it is cancelled."""
        paused = await self._paused_since()
        if paused is None:
            return
        log.info("run %s paused: step %d opens once it is resumed", self.run_id, step)
        if self.lead is not None:
            await timeline.emit(self.r, self.run_id, "held_by_pause", step=step)
        while paused is not None:
            await self._check_running()
            await asyncio.sleep(CHECK_S)
            paused = await self._paused_since()
        log.info("run %s resumed: opening step %d", self.run_id, step)

    async def _paused_since(self) -> float | None:
        record = await with_reconnect(
            lambda: run_record.read(self.r, self.run_id, "paused_at"), "run paused"
        )
        return record.paused_at if record is not None else None

    def _say_opened(self, c: StepController) -> None:
        window = c.window_s
        if self.lead is not None:
            T_SEED.set(window if window != math.inf else -1)
        log.info(
            "step %d: %d jobs on %s%s (pools %s, T_seed %.2fs)",
            c.step,
            len(c.table.requests),
            keys.jobs_stream(self.run_id, c.step),
            f" (shard {self.shard} of {self.shards})" if self.shards > 1 else "",
            c.pools,
            window,
        )

    async def _drive(self, live: LiveStep) -> StepDone:
        """Until the step's groups are published (on the leader, every shard's), tick it (the
        leader) or report how many of this shard's requests are unfinished (a follower); then
        its end."""
        table, store = live.table, live.store
        others = ShardView(self.r, self.run_id, table.step, self.shards)
        lead = self.lead
        while not await self._until_change(live, others, all_shards=lead is not None):
            if lead is None:
                await others.report_unfinished(self.shard, table.unfinished_count)
                continue
            oldest = table.step == min(self.live)  # the step the trainer waits for
            await lead.tick(live, others, self.committed, oldest, self.worker_keys)
        # complete: its last deltas are applied and stored; later ones of it are dropped
        self.live.pop(table.step, None)
        summary = live.summary()
        await store.expire_soon(JOBS_TTL_S)
        if lead is not None:
            return await lead.end(live, others, summary)
        await others.report_done(self.shard, summary)
        times = live.control.end(time.monotonic(), time.time()).times
        assert times is not None
        return StepDone(table.step, times, tuple(store.scratch_keys()))

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

    def _table(
        self, step: int, prompt_ids: list[list[int]], history: dict[int, list[list[int]]]
    ) -> RequestTable:
        """The step's request table (of episodes, in a run with an environment); its jobs
        draft from `history` and order by it as the spec says."""
        spec, rollout = self.spec, self.spec.rollout
        stops = [] if spec.sampling.ignore_eos else self.stop_ids
        args = (self.run_id, step, prompt_ids, spec.training.group_size, spec.sampling)
        table = (
            partial(EpisodeTable, max_turns=self.episodes.max_turns)
            if self.episodes is not None
            else RequestTable
        )
        return table(
            *args, spec.seed, stops, shard=self.shard, shards=self.shards, history=history,
            drafts=rollout.drafts == "history", length_aware=rollout.length_aware,
        )  # fmt: skip

    def _controller(self, table: RequestTable) -> StepController:
        """The step's controller, with the run's rules for moving requests and for reads (on
        the leader, sharing the run's `Lead`)."""
        rollout = self.spec.rollout
        return StepController(
            table,
            CollectRules.for_run(self.spec),
            rollout.fair_reads,
            rollout.max_staleness,
            lead=self.lead.policy if self.lead is not None else None,
            migration=rollout.migration,
        )

"""The rollout manager of one run: for each step, queue B x n token-level jobs on the stream of
the step's weight version, collect token deltas, score finished responses and publish complete
groups to the trainer. A thin asyncio shell: what a read of deltas changes is decided by
`core.collect.apply_batches` on the step's `RequestTable`, T_seed and N_prem by
`core.seeding.after_step`; this module reads, calls them and writes the outcome in one MULTI.

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
from dataclasses import dataclass, replace
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram
from redis.exceptions import OutOfMemoryError
from tokenizers import Tokenizer

from services.common import keys, timeline
from services.common.messages import DeltaBatch
from services.common.redis_streams import (
    StagedWrites,
    StreamConsumer,
    ensure_group,
    while_out_of_memory,
)
from services.common.run_state import committed_version, ensure_live
from services.common.runspec import RunSpec
from services.common.step_metrics import StepRow, read_step, record_step
from services.common.tasks import Example, load_task
from services.coordinator.memory import MemoryGate, RedisMemory, run_streams, stream_lengths
from services.coordinator.migration import count_migrations, fence, reclaim_dead_workers
from services.coordinator.quarantine import report_poison
from services.coordinator.scheduling import StepScheduler, alive_workers, count_pools, heartbeats
from services.coordinator.stall_watch import StallWatch
from services.coordinator.step_store import StepStore
from services.core.collect import CollectOutcome, CollectRules, apply_batches
from services.core.request_table import Applied, RequestTable
from services.core.seeding import SeedingController, StepTimes, after_step, train_compute_s

log = logging.getLogger(__name__)
DELTA_ITEMS = Counter("spotrl_coordinator_delta_items_total", "Delta items by outcome", ["outcome"])
OUTCOMES = {a.value: DELTA_ITEMS.labels(a.value) for a in Applied}  # children looked up once
TOKENS = Counter("spotrl_coordinator_tokens_total", "Response tokens collected")
GROUPS = Counter("spotrl_coordinator_groups_published_total", "Groups handed to the trainer")
ROLLOUT_S = Histogram(
    "spotrl_coordinator_rollout_seconds",
    "Rollout time of a step",
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
)
N_PREM = Gauge("spotrl_coordinator_n_prem_recommended", "Preemptible pool size worth having")
PENDING = Gauge("spotrl_coordinator_requests_pending", "Unfinished requests of the current step")
REWARD = Gauge("spotrl_coordinator_reward_mean", "Mean reward of the newest rollout step")
STEP_TOK_S = Gauge(
    "spotrl_coordinator_step_tokens_per_second", "Rollout tokens/s of the newest step (all pools)"
)

POLL_S = 0.05
DELTA_BATCH = 256
JOBS_TTL_S = 600
CHECK_S = 0.25  # period of the cancel and dead-worker checks


@dataclass(frozen=True)
class StepDone:
    """A finished rollout, as the seeding controller will need it once the step is trained."""

    step: int
    times: StepTimes  # the trainer's part is filled in by `_adapt`
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
        self.rules = CollectRules.for_run(spec)
        self.deltas = StreamConsumer(
            r, keys.deltas_stream(run_id), keys.COORDINATOR_GROUP, "coordinator", DeltaBatch
        )
        self.seeding = SeedingController()
        self.oom_stalled = False  # marked stalled because Redis refused a batch for memory

    async def run(self) -> None:
        """Drive every step; returns when version `steps` is committed. Raises RunStopped."""
        await ensure_group(self.r, self.deltas.stream, keys.COORDINATOR_GROUP)
        await self.stall.start()
        step = await self._wait_version(0)
        while step < self.spec.steps:
            done = await self._run_step(step)
            step = await self._wait_version(step + 1)
            # no restart can need the step any more: its version is trained and committed
            await self.r.unlink(*done.scratch)
            await self._adapt(done)

    async def _adapt(self, done: StepDone) -> None:
        """After the trainer committed the next version: move T_seed (Algorithm 1) and work out
        the preemptible pool size worth having."""
        trained = await read_step(self.r, self.run_id, done.step)
        train_wait_s = trained.train_wait_s or 0.0
        compute_s = train_compute_s(
            trained.train_s or 0.0, train_wait_s, trained.seed_wait_s or 0.0
        )
        times = replace(
            done.times,
            committed=time.monotonic(),
            train_compute_s=compute_s,
            train_wait_s=train_wait_s,
        )
        update = after_step(self.seeding, times)
        n_prem = None if math.isinf(update.n_prem_recommended) else update.n_prem_recommended
        row = StepRow(
            t_remote_wait_s=update.t_remote_wait_s,
            t_seed_next_s=update.t_seed_next_s,
            n_prem_recommended=update.n_prem_recommended,
        )
        await record_step(self.r, self.run_id, done.step, row)
        await self.r.hset(
            keys.run(self.run_id),
            mapping={"t_seed_s": update.t_seed_next_s, "n_prem_recommended": json.dumps(n_prem)},
        )
        N_PREM.set(n_prem or 0)

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
        began = await self._queue(table, store)
        # time of the step so far, on this process's monotonic clock
        started = time.monotonic() - max(0.0, time.time() - began)
        workers = await alive_workers(self.r, self.run_id)
        pools = count_pools(workers)
        window = self.seeding.window_s(pools["preemptible"])
        jobs = keys.jobs_stream(self.run_id, step)
        sched = StepScheduler(self.r, self.run_id, step, jobs, window, started)
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
        table.score(self._score(table, finished, examples))
        await self._collect_all(table, store, sched, examples)
        await sched.finish()
        await self.stall.resume(step)
        times = StepTimes(
            n_preemptible=pools["preemptible"],
            n_reserved=pools["reserved"],
            started=started,
            seed_end=sched.seed_end,
            rollout_end=time.monotonic(),
            committed=math.nan,  # known once the trainer commits (`_adapt`)
            train_compute_s=math.nan,
            train_wait_s=math.nan,
        )
        await self._record_rollout(table, times, window, pools)
        # kept until the next version is committed (a restart before then finds the step
        # complete); the TTL covers a coordinator that dies before it deletes them
        await self.r.expire(jobs, JOBS_TTL_S)
        await store.expire_soon(JOBS_TTL_S)
        return StepDone(
            step, times, (*store.scratch_keys(), jobs, keys.seed_done(self.run_id, step))
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

    async def _queue(self, table: RequestTable, store: StepStore) -> float:
        """Queue the step's jobs, or restore a step queued before a restart; when it began."""
        jobs = keys.jobs_stream(self.run_id, table.step)
        began = await store.restore(table)
        if began is None:
            await self.memory_gate.wait_below(self._check_running)  # backpressure
        await ensure_group(self.r, jobs, keys.WORKERS_GROUP)
        if began is None:
            began = time.time()
            async with self.r.pipeline(transaction=True) as pipe:
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
        self.deltas.replay()  # first the deltas read before a restart and never acknowledged
        while not table.complete:
            await self._collect(table, store, examples)
            PENDING.set(table.unfinished_count)
            if time.monotonic() - last_check > CHECK_S:
                await self._check_running()
                await reclaim_dead_workers(self.r, jobs, table, store, self.spec.migration)
                beats = await heartbeats(self.r)
                await sched.tick(table, beats)
                await self.stall.check(table.step, beats)
                last_check = time.monotonic()

    async def _record_rollout(
        self, table: RequestTable, times: StepTimes, window: float, pools: dict[str, int]
    ) -> None:
        step = table.step
        rollout_s = times.rollout_end - times.started
        ROLLOUT_S.observe(rollout_s)
        tokens = table.response_tokens
        mean_reward = table.mean_reward()
        seed_end = times.seed_end if times.seed_end is not None else times.rollout_end
        await record_step(
            self.r,
            self.run_id,
            step,
            StepRow(
                version=table.version,
                reward_mean=mean_reward,
                response_tokens=tokens,
                response_len_mean=tokens / len(table.requests),
                rollout_s=rollout_s,
                tokens_per_s=tokens / max(rollout_s, 1e-9),
                stale_deltas=table.stats[Applied.STALE_LEASE.value],
                tokens_received=table.tokens_received,
                tokens_discarded=table.tokens_discarded,
                regenerated_tokens=table.tokens_received - tokens,
                migrations=dict(table.migrations),
                t_seed_s=window,  # inf (no window) is stored as null
                seed_s=seed_end - times.started,
                workers_reserved=pools["reserved"],
                workers_preemptible=pools["preemptible"],
                groups_quarantined=len(table.quarantined),
                redis_mem_mib=round((await RedisMemory(self.r).read()).used_mib, 1),
                stream_lengths=await stream_lengths(self.r, run_streams(self.run_id, step)),
            ),
        )
        REWARD.set(mean_reward)
        STEP_TOK_S.set(tokens / max(rollout_s, 1e-9))
        await timeline.emit(
            self.r,
            self.run_id,
            "rollout_done",
            step=step,
            reward_mean=mean_reward,
            tokens=tokens,
            rollout_s=rollout_s,
        )
        log.info(
            "step %d: rollout done in %.2fs, %d tokens, reward %.3f",
            step,
            rollout_s,
            tokens,
            mean_reward,
        )

    def _score(
        self, table: RequestTable, rids: list[str], examples: list[Example]
    ) -> dict[str, float]:
        """Decode and score finished responses (synchronous: run it in a thread)."""
        stop = set(self.stop_ids)
        states = [table.requests[rid] for rid in rids]
        texts = self.tokenizer.decode_batch(
            [[t for t in s.token_ids if t not in stop] for s in states]
        )
        return {  # float(): a task may score with an int or a bool
            s.request_id: float(self.task.reward(text, examples[s.prompt_index]))
            for s, text in zip(states, texts, strict=True)
        }

    async def _collect(self, table: RequestTable, store: StepStore, examples: list[Example]):
        """Apply one read of delta batches (`collect.apply_batches`); then, in one MULTI: the
        requests that changed, the continuations of the requests released, the groups
        completed, and the acknowledgement and deletion of the read's entries (what they
        carried is in the request table from then on)."""
        read = await self.deltas.read(DELTA_BATCH, int(POLL_S * 1000))
        if not read.entries:
            return
        outcome = apply_batches(table, [batch for _, batch in read.messages], self.rules)
        if outcome.finished:  # decoding and scoring off the event loop
            table.score(await asyncio.to_thread(self._score, table, outcome.finished, examples))
        groups = table.completed_groups(outcome.finished)
        staged = StagedWrites()
        self._stage_outcome(staged, table, store, outcome, groups)
        self.deltas.stage_ack(staged, read.ids, delete=True)
        await while_out_of_memory(lambda: staged.execute(self.r), "store deltas", self._say_oom)
        if self.oom_stalled:
            self.oom_stalled = False
            await self.memory_gate.runs.mark_running(self.run_id, "redis takes writes again")
        if outcome.poisoned:
            await report_poison(self.r, self.spec, table, outcome.poisoned)
        for reason, jobs in outcome.released.items():
            await count_migrations(self.r, table, reason, len(jobs))
        table.mark_published(groups)
        GROUPS.inc(len(groups))
        TOKENS.inc(outcome.tokens_appended)
        for applied, n in outcome.applied.items():
            OUTCOMES[applied].inc(n)
        await fence(self.r, self.run_id, outcome.stale)
        await self.deltas.park(read, keys.parked_stream(self.run_id), "deltas")

    def _stage_outcome(
        self,
        staged: StagedWrites,
        table: RequestTable,
        store: StepStore,
        outcome: CollectOutcome,
        groups: list[int],
    ) -> None:
        store.stage_requests(staged, table, outcome.changed)
        jobs = keys.jobs_stream(self.run_id, table.version)
        for continuations in outcome.released.values():
            for job in continuations:
                staged.xadd(jobs, job.fields())
        groups_stream = keys.groups_stream(self.run_id)
        for p in groups:
            staged.xadd(groups_stream, table.group_message(p).fields())
            store.stage_published(staged, p)
        for p in outcome.dropped:
            staged.xadd(groups_stream, table.dropped_group(p).fields())
            store.stage_quarantined(staged, p)
            staged.hincrby(keys.run(self.run_id), "groups_quarantined", 1)

    async def _say_oom(self, reason: str) -> None:
        """Redis refuses writes for memory: the run is stalled, saying so, where Redis takes
        that small write (else the log and the memory gauges say it)."""
        try:
            self.oom_stalled = await self.memory_gate.runs.mark_stalled(
                self.run_id, reason, time.time()
            )
        except OutOfMemoryError as exc:
            log.warning("run %s: could not record the memory stall: %s", self.run_id, exc)

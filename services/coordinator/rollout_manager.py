"""The rollout manager of one run: for each step, queue B x n token-level jobs on the stream of
the step's weight version, collect token deltas, score finished responses and publish complete
groups to the trainer. A thin asyncio shell around `RequestTable`.

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
from prometheus_client import Counter, Gauge, Histogram
from redis.exceptions import OutOfMemoryError
from tokenizers import Tokenizer

from services.common import keys, timeline
from services.common.messages import DeltaBatch, Group, Job, Response
from services.common.redis_streams import (
    StagedWrites,
    decode_or_park,
    ensure_group,
    park,
    read_group,
    while_out_of_memory,
    with_reconnect,
)
from services.common.run_state import RunStopped
from services.common.runspec import LIVE_STATES, RunSpec
from services.common.step_metrics import record_step
from services.common.tasks import Example, load_task
from services.coordinator.memory import MemoryGate, RedisMemory, run_streams, stream_lengths
from services.coordinator.migration import count_migrations, fence, reclaim_dead_workers
from services.coordinator.quarantine import dropped_group, note_crash, report_poison
from services.coordinator.scheduling import StepScheduler, alive_workers, count_pools, heartbeats
from services.coordinator.stall_watch import StallWatch
from services.coordinator.step_store import StepStore
from services.core.request_table import Applied, RequestTable
from services.core.seeding import SeedingController, recommended_pool_size

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
    """What the seeding controller needs to know about a finished rollout."""

    step: int
    n_preemptible: int
    n_reserved: int
    started: float
    seed_end: float | None
    rollout_end: float
    window_s_used: float
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
        self.consumer = "coordinator"
        self.seeding = SeedingController()
        self.replaying = False  # reading the deltas given to us before a restart
        self.oom_stalled = False  # marked stalled because Redis refused a batch for memory

    async def run(self) -> None:
        """Drive every step; returns when version `steps` is committed. Raises RunStopped."""
        deltas = keys.deltas_stream(self.run_id)
        await ensure_group(self.r, deltas, keys.COORDINATOR_GROUP)
        await self.stall.start()
        step = await self._wait_version(0)
        while step < self.spec.steps:
            done = await self._run_step(step)
            step = await self._wait_version(step + 1)
            # no restart can need the step any more: its version is trained and committed
            await self.r.unlink(*done.scratch)
            await self._adapt(done)

    async def _adapt(self, done: "StepDone") -> None:
        """After the trainer committed the next version: move T_seed (Algorithm 1) and work out
        the preemptible pool size worth having."""
        t_remote_wait = time.monotonic() - done.rollout_end
        row = await self.r.hgetall(keys.run_step(self.run_id, done.step))
        trained = {k.decode(): json.loads(v) for k, v in row.items()}
        t_train_wait = float(trained.get("train_wait_s", 0.0))
        t_train = max(
            1e-3,
            float(trained.get("train_s", 0.0))
            - t_train_wait
            - float(trained.get("seed_wait_s", 0.0)),
        )
        t_seed_next = self.seeding.update(done.n_preemptible, t_train_wait, t_remote_wait)
        t_remote = done.rollout_end - (done.seed_end or done.started)
        n_prem = recommended_pool_size(
            t_remote if done.n_preemptible else 0.0,
            done.n_preemptible,
            done.window_s_used,
            done.n_reserved,
            t_train,
        )
        fields = {
            "t_remote_wait_s": t_remote_wait,
            "t_seed_next_s": t_seed_next,
            "n_prem_recommended": None if math.isinf(n_prem) else n_prem,
        }
        await record_step(self.r, self.run_id, done.step, fields)
        await self.r.hset(
            keys.run(self.run_id),
            mapping={
                "t_seed_s": t_seed_next,
                "n_prem_recommended": json.dumps(fields["n_prem_recommended"]),
            },
        )
        N_PREM.set(fields["n_prem_recommended"] or 0)

    async def _check_running(self) -> None:
        state = await self.r.hget(keys.run(self.run_id), "state")
        if state is None or state.decode() not in LIVE_STATES:
            raise RunStopped(state.decode() if state else "deleted")

    async def _wait_version(self, at_least: int) -> int:
        """Wait until the trainer committed a version >= at_least; return it. The trainer is
        at work meanwhile and needs no worker: no stall is looked for."""
        while True:
            await self._check_running()
            raw = await self.r.get(keys.run_version(self.run_id))
            if raw is not None and int(raw) >= at_least:
                return int(raw)
            await asyncio.sleep(POLL_S * 2)

    async def _run_step(self, step: int) -> "StepDone":
        spec = self.spec
        examples = self.task.examples(spec.seed, step, spec.prompts_per_step)
        prompts = [self.tokenizer.encode(e.prompt).ids for e in examples]
        table = RequestTable(
            self.run_id,
            step,
            step,
            prompts,
            spec.group_size,
            spec.max_new_tokens,
            spec.temperature,
            spec.top_p,
            spec.seed,
            [] if spec.ignore_eos else self.stop_ids,
        )
        jobs = keys.jobs_stream(self.run_id, step)
        store = StepStore(self.r, self.run_id, step)
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
                step,
                len(table.prompts) - len(table.pending_groups),
                len(table.prompts),
                len(table.requests) - len(table.unfinished()),
            )
        # time of the step so far, on this process's monotonic clock
        started = time.monotonic() - max(0.0, time.time() - began)
        workers = await alive_workers(self.r, self.run_id)
        pools = count_pools(workers)
        window = self.seeding.window_s(pools["preemptible"])
        sched = StepScheduler(self.r, self.run_id, step, jobs, window, started)
        await sched.start(workers)
        log.info(
            "step %d: queued %d jobs on %s (pools %s, T_seed %.2fs)",
            step,
            len(table.requests),
            jobs,
            pools,
            window,
        )
        rewards = self._rewards(
            table, [r for r, req in table.requests.items() if req.done], examples
        )
        last_check = time.monotonic()
        self.replaying = True  # first the deltas read before a restart and never acknowledged
        while not table.complete:
            await self._collect(table, store, examples, rewards)
            PENDING.set(table.unfinished_count)
            if time.monotonic() - last_check > CHECK_S:
                await self._check_running()
                await reclaim_dead_workers(self.r, jobs, table, store, spec.migration)
                beats = await heartbeats(self.r)
                await sched.tick(table, beats)
                await self.stall.check(step, beats)
                last_check = time.monotonic()
        await sched.finish()
        await self.stall.resume(step)
        rollout_end = time.monotonic()
        rollout_s = rollout_end - started
        ROLLOUT_S.observe(rollout_s)
        tokens = sum(len(r.token_ids) for r in table.requests.values())
        trained = [  # the rewards of the groups that go to the trainer
            v
            for rid, v in rewards.items()
            if table.requests[rid].prompt_index not in table.quarantined
        ]
        mean_reward = sum(trained) / max(1, len(trained))
        await record_step(
            self.r,
            self.run_id,
            step,
            {
                "version": step,
                "reward_mean": mean_reward,
                "response_tokens": tokens,
                "response_len_mean": tokens / len(table.requests),
                "rollout_s": rollout_s,
                "tokens_per_s": tokens / max(rollout_s, 1e-9),
                "stale_deltas": table.stats[Applied.STALE_LEASE.value],
                "tokens_received": table.tokens_received,
                "tokens_discarded": table.tokens_discarded,
                "regenerated_tokens": table.tokens_received - tokens,
                "migrations": dict(table.migrations),
                "t_seed_s": None if math.isinf(window) else window,
                "seed_s": (sched.seed_end or rollout_end) - started,
                "workers_reserved": pools["reserved"],
                "workers_preemptible": pools["preemptible"],
                "groups_quarantined": len(table.quarantined),
                "redis_mem_mib": round((await RedisMemory(self.r).read()).used_mib, 1),
                "stream_lengths": await stream_lengths(self.r, run_streams(self.run_id, step)),
            },
        )
        # kept until the next version is committed (a restart before then finds the step
        # complete); the TTL covers a coordinator that dies before it deletes them
        await self.r.expire(jobs, JOBS_TTL_S)
        await store.expire_soon(JOBS_TTL_S)
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
        return StepDone(
            step,
            pools["preemptible"],
            pools["reserved"],
            started,
            sched.seed_end,
            rollout_end,
            0.0 if math.isinf(window) else window,
            (*store.scratch_keys(), jobs, keys.seed_done(self.run_id, step)),
        )

    def _rewards(
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

    async def _collect(
        self, table: RequestTable, store: StepStore, examples: list[Example], rewards: dict
    ) -> None:
        """Apply one batch of deltas; then, in one MULTI: the requests that changed, the jobs of
        the requests released, the groups completed, and the acknowledgement and deletion of
        the batch's entries (what they carried is in the request table from then on)."""
        deltas = keys.deltas_stream(self.run_id)
        start = "0" if self.replaying else ">"
        entries = await with_reconnect(
            lambda: read_group(
                self.r,
                deltas,
                keys.COORDINATOR_GROUP,
                self.consumer,
                DELTA_BATCH,
                int(POLL_S * 1000),
                start,
            ),
            "read deltas",
        )
        if not entries:
            self.replaying = False
            return
        parked: list[tuple[bytes, str]] = []
        finished: list[str] = []
        changed: set[str] = set()
        tokens_before = table.tokens_appended
        stats_before = dict(table.stats)
        stale: dict[str, set[tuple[str, int]]] = {}
        released: dict[str, list[Job]] = {}
        poisoned: list[tuple[str, str]] = []  # (request, the worker it crashed last)
        before = set(table.quarantined)
        for entry in entries:
            if entry[1] is None:
                continue  # trimmed away while pending: nothing to apply, only to acknowledge
            batch = decode_or_park(DeltaBatch, entry, parked)
            if batch is None:
                continue
            for item in batch.items:
                outcome = table.apply(item)
                if outcome is Applied.APPENDED:
                    changed.add(item.request_id)
                elif outcome is Applied.FINISHED:
                    changed.add(item.request_id)
                    finished.append(item.request_id)
                elif outcome is Applied.STALE_LEASE:
                    stale.setdefault(batch.worker_id, set()).add((item.request_id, item.lease))
            crash = batch.release_reason == "crash"
            alone = len(batch.released) == 1
            for rel in batch.released:
                if crash:
                    rid, worker_id = rel.request_id, batch.worker_id
                    poison = note_crash(table, self.spec, rid, rel.lease, worker_id, alone)
                    if poison is not None:
                        changed.add(rid)  # its crash count is kept with it
                    if poison:
                        poisoned.append((rid, worker_id))
                        continue
                job = table.migrate(
                    rel.request_id,
                    batch.release_reason,
                    self.spec.migration or batch.release_reason != "preemption",
                    rel.lease,
                )
                if job is not None:
                    changed.add(rel.request_id)
                    released.setdefault(batch.release_reason, []).append(job)
        if finished:  # decoding and scoring off the event loop
            rewards.update(await asyncio.to_thread(self._rewards, table, finished, examples))
        done = {table.requests[rid].prompt_index for rid in finished}
        groups = [p for p in sorted(done) if p in table.pending_groups and table.group_done(p)]
        dropped = sorted(table.quarantined - before)
        stream = keys.jobs_stream(self.run_id, table.version)
        staged = StagedWrites()
        store.stage_requests(staged, table, changed)
        for jobs in released.values():
            for job in jobs:
                staged.xadd(stream, job.fields())
        for p in groups:
            staged.xadd(keys.groups_stream(self.run_id), self._group(table, p, rewards).fields())
            store.stage_published(staged, p)
        for p in dropped:
            staged.xadd(keys.groups_stream(self.run_id), dropped_group(table, p).fields())
            store.stage_quarantined(staged, p)
            staged.hincrby(keys.run(self.run_id), "groups_quarantined", 1)
        entry_ids = [e[0] for e in entries]
        staged.xack(deltas, keys.COORDINATOR_GROUP, *entry_ids)
        staged.xdel(deltas, *entry_ids)
        await while_out_of_memory(lambda: staged.execute(self.r), "store deltas", self._say_oom)
        if self.oom_stalled:
            self.oom_stalled = False
            await self.memory_gate.runs.mark_running(self.run_id, "redis takes writes again")
        if poisoned:
            await report_poison(self.r, self.spec, table, poisoned)
        for reason, jobs in released.items():
            await count_migrations(self.r, table, reason, len(jobs))
        table.pending_groups.difference_update(groups)
        GROUPS.inc(len(groups))
        TOKENS.inc(table.tokens_appended - tokens_before)
        for outcome, n in table.stats.items():
            if n != stats_before[outcome]:
                OUTCOMES[outcome].inc(n - stats_before[outcome])
        await fence(self.r, self.run_id, stale)
        await park(self.r, keys.parked_stream(self.run_id), "deltas", parked, entries)

    async def _say_oom(self, reason: str) -> None:
        """Redis refuses writes for memory: the run is stalled, saying so, where Redis takes
        that small write (else the log and the memory gauges say it)."""
        try:
            self.oom_stalled = await self.memory_gate.runs.mark_stalled(
                self.run_id, reason, time.time()
            )
        except OutOfMemoryError as exc:
            log.warning("run %s: could not record the memory stall: %s", self.run_id, exc)

    def _group(self, table: RequestTable, p: int, rewards: dict) -> Group:
        members = table.group(p)
        return Group(
            run_id=self.run_id,
            step=table.step,
            version=table.version,
            prompt_index=p,
            prompt_ids=table.prompts[p],
            responses=[
                Response(
                    token_ids=m.token_ids,
                    logprobs=m.logprobs,
                    reward=rewards[m.request_id],
                    finish_reason=m.finish_reason or "length",
                    leases=m.lease + 1,
                )
                for m in members
            ],
        )

"""The leader's part of a run's step loop (shard 0's, `step/loop.py`): what is the whole
step's. Each tick it reads what the step's controller needs (every worker's heartbeat, every
shard's unfinished requests, the stream's readers), hands it over and writes what comes back;
it claims the jobs of dead workers (`reclaim`), writes stall state changes, says the run's
demand on the fleet (`workers.placement.DemandNotice`), records the step once every shard's
groups are published, and after the trainer committed a step writes the seeding update. The
decisions of the whole run (seeding window, pool size, stall state) are its `Lead`'s.
"""

import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import Counter

from services.contracts import keys
from services.contracts.consumers import consumer_worker
from services.contracts.runspec import RunSpec
from services.coordinator.step.deltas import LiveStep, tell
from services.coordinator.step.record import ShardSummary, adapt, record_rollout
from services.coordinator.step.store import CLAIMER, ShardView, StepStore, loaded_workers
from services.coordinator.workers.fleet import (
    count_pools,
    crash_reports,
    heartbeats,
    registered_workers,
)
from services.coordinator.workers.keys import WorkerKeys
from services.coordinator.workers.placement import DemandNotice
from services.core.seeding import PoolSizer, SeedingController, StepTimes
from services.core.stall import Action, GoneWorker, StallTracker
from services.core.step_controller import Effects, Lead, StepController, Tick
from services.state import run_record, timeline
from services.state.runs import RunFailed, RunStore

log = logging.getLogger(__name__)
DEAD = Counter("spotrl_coordinator_workers_declared_dead_total", "Workers whose heartbeat expired")
STALLS = Counter("spotrl_coordinator_run_stalls_total", "Times the active run became stalled")
JOBS_TTL_S = 600


@dataclass(frozen=True)
class StepDone:
    """A finished rollout, as the seeding controller will need it once the step is trained."""

    step: int
    times: StepTimes  # the trainer's part is filled in by `adapt`
    scratch: tuple[str, ...]  # the step's keys, deleted once the next version is committed


class Leadership:
    """The leader's part of a step loop (shard 0's): what is the whole step's. It reads what a
    tick needs, hands it to the step's controller and writes what comes back; the decisions
    of the whole run (seeding window, pool size, stall state) are its `policy`'s."""

    def __init__(
        self,
        r: aioredis.Redis,
        run_id: str,
        spec: RunSpec,
        stall_after_s: float = 3.0,
    ) -> None:
        self.r, self.run_id, self.spec = r, run_id, spec
        self.runs = RunStore(r)
        rollout = spec.rollout
        self.policy = Lead(
            SeedingController(
                wait_share=rollout.seeding_wait_share, backoff=rollout.seeding_backoff
            ),
            PoolSizer(rollout.pool_headroom),
            StallTracker(stall_after_s, spec.faults.stall_timeout_s),
            spec.faults.max_error_share,
        )
        training = spec.training
        self.demand = DemandNotice(
            r, run_id, training.prompts_per_step * training.group_size, rollout.share
        )

    async def start(self) -> None:
        """Pick up a stall from before a restart, and the workers that served the run."""
        run = await run_record.read(self.r, self.run_id, "state", "stalled_since", "stall_reason")
        since, reason = None, ""
        if run is not None and run.state == "stalled" and run.stalled_since is not None:
            since, reason = run.stalled_since, run.stall_reason
        loaded = await loaded_workers(self.r, self.run_id, await registered_workers(self.r))
        self.policy.restore(since, reason, loaded)

    async def tick(
        self, live: LiveStep, others: ShardView, committed: int, oldest: bool, signer
    ) -> None:
        """One pass over the step: what the controller's tick needs, read; what it decides,
        written (one MULTI); the dead readers' jobs claimed and moved; the stall state."""
        control, store = live.control, live.store
        beats = await heartbeats(self.r)
        ours = {w: v for w, b in beats.items() if (v := b.serving(self.run_id)) is not None}
        count_pools(ours)  # gauges
        readers, beating = await store.readers()
        executing, pending = await store.executing()
        gone = await self._gone(beats) if oldest else []
        others_unfinished = await others.unfinished(live.table)
        tick = Tick(
            time.monotonic(), time.time(), beats, others_unfinished, executing, pending,
            readers, beating, committed, oldest, gone,
        )  # fmt: skip
        effects = control.tick(tick)
        await store.write(live.table, effects)
        self._log(control, effects)
        for reader in effects.reclaim:
            await reclaim(self.r, control, store, reader, signer)
        await self._stall(effects)
        if oldest:
            await self.demand.say(live.table.unfinished_count + others_unfinished)

    async def end(self, live: LiveStep, others: ShardView, summary: ShardSummary) -> StepDone:
        """Every shard's groups of the step are published: the controller's end written, the
        step recorded (then the run fails on too many failed calls of user code)."""
        table, store, control = live.table, live.store, live.control
        # nothing of this step waits for the fleet now: until the next step opens (in a
        # synchronous run, once the trainer has trained this one) the fleet serves other runs
        await self.demand.say(0)
        total = ShardSummary.total([summary, *(await others.summaries())])
        effects = control.end(time.monotonic(), time.time(), total.call_counts())
        await store.write(table, effects)
        self._log(control, effects)
        await self._stall(effects)
        assert effects.times is not None
        await record_rollout(
            self.r, self.run_id, table.step, table.step, total, effects.times,
            control.window_s, control.pools,
        )  # fmt: skip
        if effects.fail is not None:
            raise RunFailed(effects.fail)
        # kept until the next version is committed (a restart before then finds the step
        # complete); the TTL covers a coordinator that dies before it deletes them
        await self.r.expire(store.jobs, JOBS_TTL_S)
        await others.expire(JOBS_TTL_S)
        scratch = (
            *store.scratch_keys(),
            store.jobs,
            keys.seed_done(self.run_id, table.step),
            keys.read_cap(self.run_id, table.step),
            keys.step_shards(self.run_id, table.step),
        )
        return StepDone(table.step, effects.times, scratch)

    async def retired(self, done: StepDone) -> None:
        """The version trained on the step is committed: the seeding update."""
        await adapt(self.r, self.run_id, self.policy, done.step, done.times)

    async def _gone(self, beats) -> list[GoneWorker]:
        """How the workers seen on the run and gone now went (a stall reason names them)."""
        gone_ids = self.policy.gone_ids(beats)
        reports = await crash_reports(self.r, gone_ids)
        leaving = await self.r.mget([keys.worker_leaving(w) for w in gone_ids]) if gone_ids else []
        gone = []
        for worker_id, left in zip(gone_ids, leaving, strict=True):
            report = reports.get(worker_id)
            if report is not None and report.get("run_id") == self.run_id:
                gone.append(GoneWorker(worker_id, "crashed", str(report.get("error", ""))))
            else:
                gone.append(GoneWorker(worker_id, "left" if left else "lost"))
        return gone

    async def _stall(self, effects: Effects) -> None:
        """The run's stall state as the controller changed it; RunFailed past its timeout."""
        decision = effects.stall
        if decision is None:
            return
        if decision.action is Action.STALL:
            STALLS.inc()
            since = self.policy.stall.stalled_since or time.time()
            await self.runs.mark_stalled(self.run_id, decision.reason, since)
            log.warning("run %s stalled: %s", self.run_id, decision.reason)
        elif decision.action is Action.UPDATE:
            await self.runs.update_stall_reason(self.run_id, decision.reason)
            log.warning("run %s still stalled: %s", self.run_id, decision.reason)
        elif decision.action is Action.RESUME:
            await self.runs.mark_running(self.run_id, effects.resumed_why)
            log.info("run %s running again: %s", self.run_id, effects.resumed_why)
        elif decision.action is Action.FAIL:
            raise RunFailed(decision.reason)

    @staticmethod
    def _log(c: StepController, effects: Effects) -> None:
        if effects.paused and c.seed_end is not None:
            after = c.seed_end - c.started
            log.info(
                "step %d: seeding window over after %.2fs; %d reserved workers step aside",
                *(c.step, after, effects.paused),
            )
        if effects.recalled:
            log.warning(
                "step %d: no preemptible worker left; %d reserved workers resume it",
                *(c.step, effects.resumed),
            )
        for worker_id, count in effects.released.items():
            log.info("step %d: %s holds %d over its cap: release ordered", c.step, worker_id, count)


async def reclaim(
    r: aioredis.Redis,
    control: StepController,
    store: StepStore,
    reader: str,
    signer: WorkerKeys | None = None,
) -> Effects:
    """Claim the jobs a dead `reader` of the step's stream holds (moved to the coordinator's
    own consumer), hand them to the controller, write what it decides (new leases, their
    continuation jobs, the releases handed to other shards, signed by `signer` where workers
    sign their deltas, the claimed entries acknowledged and the reader's consumer deleted) in
    one MULTI, and tell it. Entries claimed by a coordinator that died before that MULTI are
    pending under its consumer and are reclaimed the same way on the next pass."""
    table = control.table
    ids, jobs = await store.claim(reader)
    effects = control.on_claimed(reader, ids, jobs, CLAIMER)
    handed = {
        shard: await signer.entry(batch) if signer is not None else batch.fields()
        for shard, batch in effects.handed.items()
    }
    await store.write(table, effects, handed)
    await tell(r, table, effects)
    moved = len(effects.jobs)
    handed_count = sum(len(batch.released) for batch in effects.handed.values())
    if effects.dead_worker is None:
        log.warning(
            "re-queued %d jobs claimed before a coordinator restart (%d to other shards)",
            moved,
            handed_count,
        )
        return effects
    DEAD.inc()
    worker = consumer_worker(effects.dead_worker)
    await timeline.emit(
        r, table.run_id, "worker_reclaimed", worker=worker, jobs=len(ids), step=table.step
    )
    log.warning(
        "worker %s missed its heartbeat: migrated %d of its %d jobs (%d by other shards)",
        worker,
        moved,
        len(ids),
        handed_count,
    )
    return effects


async def reclaim_dead_workers(
    r: aioredis.Redis, control: StepController, store: StepStore, signer: WorkerKeys | None = None
) -> list[str]:
    """The reclaim of a tick alone: the jobs of every reader of the step's stream that the
    controller finds dead, moved; the workers declared dead."""
    readers, beating = await store.readers()
    dead = []
    for reader in control.dead_readers(readers, beating):
        effects = await reclaim(r, control, store, reader, signer)
        if effects.dead_worker is not None:
            dead.append(consumer_worker(effects.dead_worker))
    return dead

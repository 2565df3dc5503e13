"""One run's trainer: publish its base weights as version 0 (or resume where a crashed trainer
left it), then for each step consume the step's B groups as they arrive (backpropagating each
on arrival), step the optimizer once, and publish version v+1 (publishing.py). At exit, the
state of the newest version is checkpointed.

Groups are acknowledged, and deleted from the stream, only after the version they trained is
committed: until then a restarted trainer finds every group of its step again (the groups
consumer replays them first). Which groups a step takes is `intake.StepIntake`'s call; what the
step took is kept in the trained ledger (services.state.ledger), and, with `rollouts_dir` set,
as JSON lines on disk. `loop.TrainerLoop` finds the runs and builds one of these for each.
"""

import asyncio
import logging
import time
from typing import cast

import msgspec
import redis.asyncio as aioredis
from prometheus_client import Counter, Histogram

from services.contracts import keys
from services.contracts.messages import FIELD, Group
from services.contracts.runspec import RunSpec
from services.infra.compute import compute
from services.infra.redis_streams import Read, StreamConsumer, decode_or_park
from services.state import ledger, trainer_state
from services.state.run_state import committed_version, ensure_live, wait_announced
from services.state.step_metrics import StepRow, record_step
from services.trainer.checkpoint import BackgroundWriter, Checkpoint, Checkpoints, due
from services.trainer.intake import StepIntake
from services.trainer.protocol import ScheduledPolicy, TrainablePolicy
from services.trainer.publishing import StepPublisher
from services.trainer.rollouts import write_rollouts
from services.trainer.settings import TrainerSettings
from services.trainer.versions import VersionPublisher

log = logging.getLogger(__name__)
STEP_S = Histogram("spotrl_trainer_step_seconds", "Wall time of an RL step in the trainer")
WAIT_S = Counter("spotrl_trainer_wait_seconds_total", "Seconds idle waiting for groups")
READ_BLOCK_MS = 100  # one read of the groups stream waits this long for new groups
CHECK_S = 0.5  # while waiting for groups, the run's state is checked this often
SEED_WAIT_MS = 200  # a wait for the seeding window's end checks the run's state this often


async def wait_seeding(r: aioredis.Redis, run_id: str, step: int) -> float:
    """The reserved pool generates first (it shares this hardware): wait for it to step aside
    before consuming the step's groups; the seconds waited."""
    started = time.monotonic()
    done = keys.seed_done(run_id, step)
    while not await wait_announced(
        r, keys.seeding_over(run_id), lambda: r.exists(done), bool, SEED_WAIT_MS
    ):
        await ensure_live(r, run_id)
    return time.monotonic() - started


class RunTrainer:
    """Trains one run: its id, spec, policy, groups consumer and checkpoints."""

    def __init__(
        self,
        settings: TrainerSettings,
        r: aioredis.Redis,
        versions: VersionPublisher,
        run_id: str,
        spec: RunSpec,
        policy: TrainablePolicy,
        groups: StreamConsumer[Group],
        ckpts: Checkpoints,
    ) -> None:
        self.settings, self.r, self.versions = settings, r, versions
        self.run_id, self.spec, self.policy = run_id, spec, policy
        self.groups, self.ckpts = groups, ckpts
        self.publisher = StepPublisher(r, versions, run_id, policy, groups.stream)
        self.writer = BackgroundWriter(ckpts)
        self.status: dict = {"run_id": run_id, "step": 0, "state": "loading"}
        self.ahead: list[tuple[bytes, Group]] = []  # later steps' groups, unacknowledged
        self.weights_of = 0  # the version the policy's weights are
        self.checkpointed = (0, time.monotonic())  # (step, time) of the newest checkpoint

    async def train(self) -> None:
        """Train the run's remaining steps; RunStopped when it is cancelled or fails."""
        step = await self._start()
        try:
            while step < self.spec.training.steps:
                await ensure_live(self.r, self.run_id)
                self.status = {"run_id": self.run_id, "step": step, "state": "training"}
                await self._train_step(step)
                step += 1
            await self.publisher.published()
        finally:
            await self.publisher.finish_at_exit()
            # at exit too (SIGTERM cancels this task): the state of the newest version, once
            # the write in flight (if any) is done
            self.writer.close()
            latest = self.ckpts.latest()
            if latest is None or latest.step < self.weights_of:
                meta = {"run_id": self.run_id, "at_exit": True}
                self.ckpts.save(self.weights_of, self.policy.snapshot, meta)
                log.info("run %s: checkpointed version %d at exit", self.run_id, self.weights_of)
        self.status = {"run_id": self.run_id, "step": step, "state": "done"}
        log.info("run %s: trained %d steps", self.run_id, step)

    async def _start(self) -> int:
        """Version 0 for a new run, or where a run under way was; the step to train next."""
        version = await committed_version(self.r, self.run_id)
        if version is None:
            await self.versions.commit(self.run_id, self.policy, 0)
            await self.versions.announce(self.run_id, 0)
            step = 0
        else:
            step = await self._resume(version)
        self.weights_of = step
        self.publisher.announced_at = time.monotonic()
        latest = self.ckpts.latest()
        self.checkpointed = (latest.step if latest else step, time.monotonic())
        return step

    async def _resume(self, version: int) -> int:
        """A run already under way: continue from the newest checkpoint and the announced
        version; the step to train next."""
        run_id, policy = self.run_id, self.policy
        ckpt = await self._checkpoint_within(version)
        if ckpt is not None:
            await compute(policy.restore, ckpt.folder)
        checkpointed = ckpt is not None and ckpt.step == version + 1
        trained = await trainer_state.read(self.r, run_id, "steps_trained")
        # the crash came after step `version`'s version was committed and its groups retired,
        # before the announcement: those groups are gone, the version is in the store
        retired = trained is not None and trained.steps_trained > version
        if checkpointed or retired:
            # step `version` was trained; its version was never announced. A commit of it
            # before the crash is taken, only with the digest recorded for it: the weights
            # the workers will pull (a checkpoint of an earlier step holds other weights)
            await self.versions.commit(run_id, policy, version + 1)
            await self._ack_pending(version)
            await record_step(self.r, run_id, version, StepRow(trainer_resumed=True))
            await trainer_state.set_steps_trained(self.r, run_id, version + 1)
            await self.versions.announce(run_id, version + 1)
            if checkpointed:
                log.info("run %s: resumed after step %d from its checkpoint", run_id, version)
            else:
                if isinstance(policy, ScheduledPolicy):
                    policy.schedule_at(version + 1)
                log.warning(
                    "run %s: resumed after step %d from the weight store (its version was "
                    "committed, not announced; optimizer state from %s)",
                    run_id,
                    version,
                    "none" if ckpt is None else f"step {ckpt.step}",
                )
            return version + 1
        if ckpt is None or ckpt.step < version:
            # behind the announced version: take that version's weights, what workers hold
            await self.versions.take(run_id, policy, version)
            if isinstance(policy, ScheduledPolicy):  # a benchmark's stand-in has no schedule
                policy.schedule_at(version)
            log.warning(
                "run %s: resumed at version %d from the weight store (checkpoint: %s)",
                run_id,
                version,
                "none" if ckpt is None else f"step {ckpt.step}, optimizer state from then",
            )
        else:
            log.info("run %s: resumed at step %d from its checkpoint", run_id, version)
        return version

    async def _checkpoint_within(self, version: int) -> Checkpoint | None:
        """The newest checkpoint of a state the run in Redis can be at: at most the committed
        `version`, or the one after it where Redis holds the ledger of the step that made it
        (the trainer stopped between its checkpoint and the announcement). A newer one is of
        groups a Redis failover lost (the new primary lacked the old one's last writes): it is
        discarded, and the step is trained again from what Redis holds."""
        ckpt = self.ckpts.latest()
        if ckpt is None or ckpt.step <= version:
            return ckpt
        step_kept = await self.r.hexists(keys.run_trained(self.run_id), str(version))
        if ckpt.step == version + 1 and step_kept:
            return ckpt
        kept = self.ckpts.discard_after(version)
        log.warning(
            "run %s: the checkpoint of version %d is ahead of what Redis holds (version %d "
            "committed%s): discarded, training from %s",
            self.run_id,
            ckpt.step,
            version,
            "" if step_kept else f", no record of step {version}",
            "the store's weights" if kept is None else f"the checkpoint of {kept.step}",
        )
        return kept

    async def _ack_pending(self, version: int) -> None:
        """Retire the groups read before the crash of steps up to `version` (trained into the
        version just committed); those of later steps in flight stay, to be read again."""
        stream = self.groups.stream
        pending = await self.r.xpending_range(
            stream, keys.TRAINER_GROUP, min="-", max="+", count=100_000, consumername="trainer"
        )
        ids = [cast(bytes, p["message_id"]) for p in pending]
        if not ids:
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for entry_id in ids:
                pipe.xrange(stream, entry_id, entry_id)
            found = await pipe.execute()
        done = []
        for entry_id, entries in zip(ids, found, strict=True):
            group = decode_or_park(Group, entries[0], []) if entries else None
            if group is None or group.step <= version:
                done.append(entry_id)
        await self.publisher.retire(done)

    async def _train_step(self, step: int) -> None:
        """One RL step: wait for the seeding, take and train on the step's groups, then step
        the optimizer, checkpoint when due, commit and announce the version, and record what
        the step took."""
        started = time.monotonic()
        seed_wait_s = await wait_seeding(self.r, self.run_id, step)
        spec = self.spec
        intake = StepIntake(
            self.run_id,
            step,
            spec.training.prompts_per_step,
            spec.training.group_size,
            staleness=spec.rollout.max_staleness,
        )
        wait_s, compute_s = await self._take_groups(intake)
        self.ahead = intake.ahead
        WAIT_S.inc(wait_s)
        await self.publisher.published()  # the version before this one is out (with k >= 1)
        t0 = time.monotonic()
        # what the step took is kept while the optimizer steps (another thread, and Redis)
        stats, _ = await asyncio.gather(
            compute(self.policy.optimizer_step), self._keep_intake(step, intake)
        )
        compute_s += time.monotonic() - t0
        self.weights_of = step + 1
        checkpoint_s = await self._checkpoint(step + 1, intake)
        train_s = time.monotonic() - started
        STEP_S.observe(train_s)
        row = msgspec.structs.replace(
            stats,
            train_s=train_s,
            train_wait_s=wait_s,
            seed_wait_s=seed_wait_s,
            train_compute_s=compute_s,
            checkpoint_s=checkpoint_s,
            groups_incomplete=intake.ledger.incomplete,
        )
        # with k >= 1 the next step's held groups train while this version goes out
        await self.publisher.start(step, intake, row, background=spec.rollout.max_staleness > 0)

    async def _checkpoint(self, version: int, intake: StepIntake) -> float:
        """Checkpoint the state of `version` when due and no write is in flight: the step waits
        only for the state to be serialized; the seconds it waited."""
        last_step, last_s = self.checkpointed
        every, every_s = self.settings.checkpoint_every, self.settings.checkpoint_every_s
        writer = self.writer
        if writer.busy or not due(version, last_step, last_s, time.monotonic(), every, every_s):
            return 0.0
        t0 = time.monotonic()
        write = await compute(self.policy.snapshot, writer.ckpts.scratch(version))
        writer.submit(version, write, {"run_id": self.run_id, "last_group": intake.last_entry})
        self.checkpointed = (version, time.monotonic())
        return time.monotonic() - t0

    async def _take_groups(self, intake: StepIntake) -> tuple[float, float]:
        """Read groups and train on those the step takes until it has B; the seconds spent
        waiting for new groups (replaying those read before a restart is no wait) and those
        spent training on them."""
        wait_s = compute_s = 0.0
        if self.ahead:  # read during an earlier step: first
            held = Read([(i, {FIELD: g.encode()}) for i, g in self.ahead], list(self.ahead), [])
            self.ahead = []
            compute_s += await self._train_on(intake, held)
        last_check = time.monotonic()
        while intake.missing > 0:
            t0 = time.monotonic()
            replaying = self.groups.replaying
            read = await self.groups.read(intake.missing, READ_BLOCK_MS)
            if not read.entries:
                if replaying:
                    continue  # the replay is over: new groups from now on
                wait_s += time.monotonic() - t0
                if time.monotonic() - last_check > CHECK_S:
                    await ensure_live(self.r, self.run_id)
                    last_check = time.monotonic()
                continue
            compute_s += await self._train_on(intake, read)
        return wait_s, compute_s

    async def _train_on(self, intake: StepIntake, read: Read) -> float:
        """Take what the step takes of `read`, park what it refuses, train on the rest; the
        seconds spent training."""
        good = intake.take(read)
        await self.groups.park(read, keys.parked_stream(self.run_id), "groups")
        if not good:
            return 0.0
        t0 = time.monotonic()
        await compute(self.policy.accumulate, good)
        return time.monotonic() - t0

    async def _keep_intake(self, step: int, intake: StepIntake) -> None:
        """The step's ledger in Redis and, with `rollouts_dir`, its groups on disk."""
        await ledger.write_step(self.r, self.run_id, step, intake.ledger)
        if self.settings.rollouts_dir is not None:
            folder = self.settings.rollouts_dir / self.run_id
            await asyncio.to_thread(write_rollouts, folder, step, intake.kept)

"""The trainer loop: wait for the active run, publish its base weights as version 0, then for
each step consume the step's B groups as they arrive (backpropagating each on arrival), step the
optimizer once, commit version v+1 to the weight store and announce it. With max_staleness
k >= 1 the commit and announcement run beside the next step's first groups (held or read), and
the next optimizer step waits for them: versions still go out in order, one at a time.

Groups are acknowledged, and deleted from the stream, only after the version they trained is
committed: until then a restarted trainer finds every group of its step again (the groups
consumer replays them first). Which groups a step takes is `intake.StepIntake`'s call; what the
step took is kept in the trained ledger (services.state.ledger), and, with `rollouts_dir` set,
as JSON lines on disk. Versions are committed, announced and taken back by `versions.py`.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram

from services.contracts import keys
from services.contracts.messages import FIELD, Group
from services.contracts.runspec import RunSpec
from services.infra.cancel import cancel_and_wait
from services.infra.compute import compute
from services.infra.redis_streams import (
    Read,
    StreamConsumer,
    decode_or_park,
    ensure_group,
    with_reconnect,
)
from services.infra.retry import brief
from services.state import ledger, timeline
from services.state.run_state import (
    RunStopped,
    active_run,
    committed_version,
    ensure_live,
    wait_announced,
)
from services.state.step_metrics import StepRow, record_step
from services.trainer.checkpoint import BackgroundWriter, Checkpoints, due
from services.trainer.intake import StepIntake
from services.trainer.rollouts import write_rollouts
from services.trainer.settings import TrainerSettings
from services.trainer.versions import VersionPublisher
from services.weights.transfer import WeightClient

log = logging.getLogger(__name__)
STEPS = Counter("spotrl_trainer_steps_total", "Optimizer steps")
STEP_S = Histogram("spotrl_trainer_step_seconds", "Wall time of an RL step in the trainer")
WAIT_S = Counter("spotrl_trainer_wait_seconds_total", "Seconds idle waiting for groups")
LAST_WAIT_S = Gauge("spotrl_trainer_last_wait_seconds", "Seconds idle for groups, newest step")
LOSS = Gauge("spotrl_trainer_policy_loss", "Policy loss of the newest step")
READ_BLOCK_MS = 100  # one read of the groups stream waits this long for new groups
CHECK_S = 0.5  # while waiting for groups, the run's state is checked this often
PUBLISH_AT_EXIT_S = 10.0  # a publication in flight at exit may take this long to end
SEED_WAIT_MS = 200  # a wait for the seeding window's end checks the run's state this often


def default_policy(model_dir: Path, spec: RunSpec, device: str) -> Any:
    """The run's policy: a Hugging Face model (imported only when a run needs it), sharded over
    the ranks when the trainer runs as several (ranks.py)."""
    from services.trainer import ranks

    if ranks.world_size() > 1:
        return ranks.lead(model_dir, spec, device)
    from services.trainer.policy import Policy

    return Policy(model_dir, spec, device)


class TrainerLoop:
    def __init__(
        self,
        settings: TrainerSettings,
        r: aioredis.Redis,
        policy_factory: Callable[[Path, RunSpec, str], Any] | None = None,
    ) -> None:
        self.settings = settings
        # builds the policy of a run (model folder, spec, device); benchmarks pass a stand-in
        self.policy_factory = policy_factory
        self.r = r
        self.weights = WeightClient(settings.weightstore_urls(), settings.api_token)
        self.versions = VersionPublisher(r, self.weights, settings.work_dir)
        self.status: dict = {"run_id": None, "step": None, "state": "idle"}
        self.weights_of = 0  # the version the policy's weights are
        self.announced_at = time.monotonic()  # when the newest version was announced
        self.checkpointed = (0, time.monotonic())  # (step, time) of the newest checkpoint
        # with max_staleness >= 1: the publication of the newest version, while the next
        # step's groups train; awaited before the next optimizer step
        self.publishing: asyncio.Task | None = None

    async def forever(self) -> None:
        while True:
            run_id = await with_reconnect(lambda: active_run(self.r), "active run")
            if run_id is None:
                self.status = {"run_id": None, "step": None, "state": "idle"}
                await asyncio.sleep(self.settings.poll_s)
                continue
            try:
                await self.train_run(run_id)
            except RunStopped as exc:
                log.info("run %s stopped: %s", run_id, exc)
            # wait for the coordinator to move on from this run
            while await active_run(self.r) == run_id:
                await asyncio.sleep(self.settings.poll_s)

    async def train_run(self, run_id: str) -> None:
        raw_spec = await self.r.hget(keys.run(run_id), "spec")
        if raw_spec is None:
            raise RunStopped("deleted")
        spec = RunSpec.model_validate_json(raw_spec)
        self.status = {"run_id": run_id, "step": 0, "state": "loading"}
        factory = self.policy_factory or default_policy
        policy = await compute(factory, Path(spec.model), spec, self.settings.device)
        groups_stream = keys.groups_stream(run_id)
        await ensure_group(self.r, groups_stream, keys.TRAINER_GROUP)
        # first the groups read before a restart and never acknowledged, then new ones
        groups = StreamConsumer(
            self.r, groups_stream, keys.TRAINER_GROUP, "trainer", Group, replay=True
        )
        self.ahead: list[tuple[bytes, Group]] = []  # later steps' groups, unacknowledged
        ckpts = Checkpoints(
            self.settings.work_dir / run_id / "checkpoints", self.settings.keep_checkpoints
        )
        version = await committed_version(self.r, run_id)
        if version is None:
            await self.versions.commit(run_id, policy, 0)
            await self.versions.announce(run_id, 0)
            step = 0
        else:
            step = await self._resume(run_id, policy, ckpts, version)
        self.weights_of = step
        self.announced_at = time.monotonic()
        latest = ckpts.latest()
        self.checkpointed = (latest.step if latest else step, time.monotonic())
        writer = BackgroundWriter(ckpts)
        try:
            while step < spec.steps:
                await ensure_live(self.r, run_id)
                self.status = {"run_id": run_id, "step": step, "state": "training"}
                await self._train_step(run_id, spec, policy, step, writer, groups)
                step += 1
            await self._published()
        finally:
            await self._finish_publishing()
            # at exit too (SIGTERM cancels this task): the state of the newest version, once
            # the write in flight (if any) is done
            writer.close()
            latest = ckpts.latest()
            if latest is None or latest.step < self.weights_of:
                meta = {"run_id": run_id, "at_exit": True}
                ckpts.save(self.weights_of, policy.snapshot, meta)
                log.info("run %s: checkpointed version %d at exit", run_id, self.weights_of)
        self.status = {"run_id": run_id, "step": step, "state": "done"}
        log.info("run %s: trained %d steps", run_id, step)

    async def _resume(self, run_id: str, policy, ckpts: Checkpoints, version: int) -> int:
        """A run already under way: continue from the newest checkpoint and the announced
        version; the step to train next."""
        ckpt = ckpts.latest()
        if ckpt is not None:
            await compute(policy.restore, ckpt.folder)
        if ckpt is not None and ckpt.step == version + 1:
            # step `version` was trained and checkpointed; its version was never announced (a
            # commit of it before the crash is taken only with the digest recorded for it)
            await self.versions.commit(run_id, policy, version + 1)
            await self._ack_pending(run_id, version)
            await record_step(self.r, run_id, version, StepRow(trainer_resumed=True))
            await self.r.hset(keys.trainer_state(run_id), "steps_trained", version + 1)
            await self.versions.announce(run_id, version + 1)
            log.info("run %s: resumed after step %d from its checkpoint", run_id, version)
            return version + 1
        if ckpt is None or ckpt.step < version:
            # behind the announced version: take that version's weights, what workers hold
            await self.versions.take(run_id, policy, version)
            if hasattr(policy, "schedule_at"):  # a benchmark's stand-in has no schedule
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

    async def _ack_pending(self, run_id: str, version: int) -> None:
        """Retire the groups read before the crash of steps up to `version` (trained into the
        version just committed); those of later steps in flight stay, to be read again."""
        stream = keys.groups_stream(run_id)
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
        await self._retire(stream, done)

    async def _retire(
        self, stream: str, entry_ids: list[bytes], also: Callable[[Any], None] | None = None
    ) -> None:
        """The groups trained into a committed version: acknowledged and deleted at once, in
        one transaction with what `also` stages on it."""
        if not entry_ids and also is None:
            return
        async with self.r.pipeline(transaction=True) as pipe:
            if entry_ids:
                pipe.xack(stream, keys.TRAINER_GROUP, *entry_ids)
                pipe.xdel(stream, *entry_ids)
            if also is not None:
                also(pipe)
            await pipe.execute()

    async def _train_step(
        self,
        run_id: str,
        spec: RunSpec,
        policy,
        step: int,
        writer: BackgroundWriter,
        groups: StreamConsumer[Group],
    ) -> None:
        """One RL step: wait for the seeding, take and train on the step's groups, then step
        the optimizer, checkpoint when due, commit and announce the version, and record what
        the step took."""
        started = time.monotonic()
        seed_wait_s = await self._wait_seeding(run_id, step)
        intake = StepIntake(
            run_id, step, spec.prompts_per_step, spec.group_size, staleness=spec.max_staleness
        )
        wait_s, compute_s = await self._take_groups(run_id, policy, intake, groups)
        self.ahead = intake.ahead
        WAIT_S.inc(wait_s)
        await self._published()  # the version before this one is out (with k >= 1)
        t0 = time.monotonic()
        # what the step took is kept while the optimizer steps (another thread, and Redis)
        stats, _ = await asyncio.gather(
            compute(policy.optimizer_step), self._keep_intake(run_id, step, intake)
        )
        compute_s += time.monotonic() - t0
        self.weights_of = step + 1
        checkpoint_s = await self._checkpoint(run_id, policy, step + 1, writer, intake)
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
        publish = self._publish(run_id, policy, step, intake, groups.stream, row)
        if spec.max_staleness == 0:
            await publish
        else:  # the next step's held groups train while this version goes out
            self.publishing = asyncio.create_task(publish)

    async def _finish_publishing(self) -> None:
        """At exit: let a publication in flight end (it is short), else cancel it (a commit is
        atomic; a version committed and not announced is announced on resume)."""
        task, self.publishing = self.publishing, None
        if task is None:
            return
        await asyncio.wait({task}, timeout=PUBLISH_AT_EXIT_S)
        if not task.done():
            log.warning("a version's publication was cut short at exit")
            with contextlib.suppress(asyncio.CancelledError):
                await cancel_and_wait([task])  # its Redis and store calls can lose one cancel
        if task.done() and not task.cancelled():
            error = task.exception()
            if isinstance(error, Exception):
                log.error("a version's publication failed at exit: %s", brief(error))

    async def _published(self) -> None:
        """Wait for the version being published, if one is (its errors are the step's)."""
        task, self.publishing = self.publishing, None
        if task is not None:
            await task

    async def _publish(
        self, run_id: str, policy, step: int, intake: StepIntake, stream: str, row: StepRow
    ) -> None:
        """Commit and announce the version the step made, retire its groups, record its row
        (what the step trained, completed here with the publication's time)."""
        publish_s = await self.versions.commit(run_id, policy, step + 1)
        await self._retire(stream, intake.entry_ids, self._count_trained(run_id, step, intake))
        STEPS.inc()
        row = msgspec.structs.replace(
            row, publish_s=publish_s, step_s=time.monotonic() - self.announced_at
        )
        # the row is complete before the version is announced: the coordinator reads it then
        await record_step(self.r, run_id, step, row)
        await self.versions.announce(run_id, step + 1)
        self.announced_at = time.monotonic()
        await self._report(run_id, step, intake, row)

    async def _checkpoint(
        self, run_id: str, policy, version: int, writer: BackgroundWriter, intake: StepIntake
    ) -> float:
        """Checkpoint the state of `version` when due and no write is in flight: the step waits
        only for the state to be serialized; the seconds it waited."""
        last_step, last_s = self.checkpointed
        every, every_s = self.settings.checkpoint_every, self.settings.checkpoint_every_s
        if writer.busy or not due(version, last_step, last_s, time.monotonic(), every, every_s):
            return 0.0
        t0 = time.monotonic()
        write = await compute(policy.snapshot, writer.ckpts.scratch(version))
        writer.submit(version, write, {"run_id": run_id, "last_group": intake.last_entry})
        self.checkpointed = (version, time.monotonic())
        return time.monotonic() - t0

    async def _take_groups(
        self,
        run_id: str,
        policy,
        intake: StepIntake,
        groups: StreamConsumer[Group],
    ) -> tuple[float, float]:
        """Read groups and train on those the step takes until it has B; the seconds spent
        waiting for new groups (replaying those read before a restart is no wait) and those
        spent training on them."""
        wait_s = compute_s = 0.0
        if self.ahead:  # read during an earlier step: first
            held = Read([(i, {FIELD: g.encode()}) for i, g in self.ahead], list(self.ahead), [])
            self.ahead = []
            compute_s += await self._train_on(run_id, policy, intake, groups, held)
        last_check = time.monotonic()
        while intake.missing > 0:
            t0 = time.monotonic()
            replaying = groups.replaying
            read = await groups.read(intake.missing, READ_BLOCK_MS)
            if not read.entries:
                if replaying:
                    continue  # the replay is over: new groups from now on
                wait_s += time.monotonic() - t0
                if time.monotonic() - last_check > CHECK_S:
                    await ensure_live(self.r, run_id)
                    last_check = time.monotonic()
                continue
            compute_s += await self._train_on(run_id, policy, intake, groups, read)
        return wait_s, compute_s

    async def _train_on(
        self, run_id: str, policy, intake: StepIntake, groups: StreamConsumer[Group], read: Read
    ) -> float:
        """Take what the step takes of `read`, park what it refuses, train on the rest; the
        seconds spent training."""
        good = intake.take(read)
        await groups.park(read, keys.parked_stream(run_id), "groups")
        if not good:
            return 0.0
        t0 = time.monotonic()
        await compute(policy.accumulate, good)
        return time.monotonic() - t0

    async def _keep_intake(self, run_id: str, step: int, intake: StepIntake) -> None:
        """The step's ledger in Redis and, with `rollouts_dir`, its groups on disk."""
        await ledger.write_step(self.r, run_id, step, intake.ledger)
        if self.settings.rollouts_dir is not None:
            folder = self.settings.rollouts_dir / run_id
            await asyncio.to_thread(write_rollouts, folder, step, intake.kept)

    @staticmethod
    def _count_trained(run_id: str, step: int, intake: StepIntake) -> Callable[[Any], None]:
        """What a trained step adds to the trainer's state, staged on a pipeline."""

        def stage(pipe) -> None:
            state = keys.trainer_state(run_id)
            pipe.hincrby(state, "groups_incomplete", intake.ledger.incomplete)
            pipe.hincrby(state, "groups_trained", intake.trained)
            pipe.hset(state, "steps_trained", step + 1)

        return stage

    async def _report(self, run_id: str, step: int, intake: StepIntake, row: StepRow) -> None:
        """The step's gauges, timeline event and log line."""
        LAST_WAIT_S.set(row.train_wait_s or 0.0)
        LOSS.set(row.policy_loss or 0.0)
        await timeline.emit(
            self.r,
            run_id,
            "trained",
            step=step,
            train_s=row.train_s,
            wait_s=row.train_wait_s,
            policy_loss=row.policy_loss,
        )
        log.info(
            "run %s step %d: trained %d groups in %.2fs (waited %.2fs after %.2fs of "
            "seeding), loss %.4f",
            run_id,
            step,
            intake.trained,
            row.train_s,
            row.train_wait_s,
            row.seed_wait_s,
            row.policy_loss,
        )

    async def _wait_seeding(self, run_id: str, step: int) -> float:
        """The reserved pool generates first (it shares this hardware): wait for it to step
        aside before consuming groups."""
        started = time.monotonic()
        done = keys.seed_done(run_id, step)
        while not await wait_announced(
            self.r, keys.seeding_over(run_id), lambda: self.r.exists(done), bool, SEED_WAIT_MS
        ):
            await ensure_live(self.r, run_id)
        return time.monotonic() - started

"""The publication of the versions one run's steps make: commit the version, retire the groups
it trained (acknowledged and deleted with the trainer's counts, in one transaction), record the
step's metrics row, announce the version, then the step's gauges, timeline event and log line.

With max_staleness k >= 1 a publication runs beside the next step's first groups; there is at
most one in flight, and the next optimizer step waits for it (`published`), so versions still
go out in order. Versions themselves are committed and announced by `versions.py`.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge

from services.contracts import keys
from services.infra.cancel import cancel_and_wait
from services.infra.retry import brief
from services.state import timeline, trainer_state
from services.state.step_metrics import StepRow, record_step
from services.trainer.intake import StepIntake
from services.trainer.protocol import TrainablePolicy
from services.trainer.versions import VersionPublisher

log = logging.getLogger(__name__)
STEPS = Counter("spotrl_trainer_steps_total", "Optimizer steps")
LAST_WAIT_S = Gauge("spotrl_trainer_last_wait_seconds", "Seconds idle for groups, newest step")
LOSS = Gauge("spotrl_trainer_policy_loss", "Policy loss of the newest step")
PUBLISH_AT_EXIT_S = 10.0  # a publication in flight at exit may take this long to end


class StepPublisher:
    """Publishes the versions of one run, from one trainer, one at a time."""

    def __init__(
        self,
        r: aioredis.Redis,
        versions: VersionPublisher,
        run_id: str,
        policy: TrainablePolicy,
        stream: str,
    ) -> None:
        self.r, self.versions = r, versions
        self.run_id, self.policy, self.stream = run_id, policy, stream
        self.announced_at = time.monotonic()  # when the newest version was announced
        # with max_staleness >= 1: the publication of the newest version, while the next
        # step's groups train; awaited before the next optimizer step
        self.in_flight: asyncio.Task | None = None

    async def start(self, step: int, intake: StepIntake, row: StepRow, background: bool) -> None:
        """Publish the version `step` made: now, or with `background` beside what follows."""
        publish = self._publish(step, intake, row)
        if background:
            self.in_flight = asyncio.create_task(publish)
        else:
            await publish

    async def published(self) -> None:
        """Wait for the version being published, if one is (its errors are the step's)."""
        task, self.in_flight = self.in_flight, None
        if task is not None:
            await task

    async def finish_at_exit(self) -> None:
        """At exit: let a publication in flight end (it is short), else cancel it (a commit is
        atomic; a version committed and not announced is announced on resume)."""
        task, self.in_flight = self.in_flight, None
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

    async def retire(
        self, entry_ids: list[bytes], also: Callable[[Any], None] | None = None
    ) -> None:
        """The groups trained into a committed version: acknowledged and deleted at once, in
        one transaction with what `also` stages on it."""
        if not entry_ids and also is None:
            return
        async with self.r.pipeline(transaction=True) as pipe:
            if entry_ids:
                pipe.xack(self.stream, keys.TRAINER_GROUP, *entry_ids)
                pipe.xdel(self.stream, *entry_ids)
            if also is not None:
                also(pipe)
            await pipe.execute()

    async def _publish(self, step: int, intake: StepIntake, row: StepRow) -> None:
        """Commit and announce the version the step made, retire its groups, record its row
        (what the step trained, completed here with the publication's time)."""
        run_id = self.run_id
        publish_s = await self.versions.commit(run_id, self.policy, step + 1)
        await self.retire(intake.entry_ids, self._count_trained(step, intake))
        STEPS.inc()
        row = msgspec.structs.replace(
            row,
            publish_s=publish_s,
            version_bytes=self.versions.version_bytes,
            step_s=time.monotonic() - self.announced_at,
        )
        # the row is complete before the version is announced: the coordinator reads it then
        await record_step(self.r, run_id, step, row)
        await self.versions.announce(run_id, step + 1)
        self.announced_at = time.monotonic()
        await self._report(step, intake, row)

    def _count_trained(self, step: int, intake: StepIntake) -> Callable[[Any], None]:
        """What a trained step adds to the trainer's state, staged on a pipeline."""
        run_id = self.run_id

        def stage(pipe) -> None:
            trainer_state.stage_step_trained(
                pipe, run_id, step, intake.trained, intake.ledger.incomplete
            )

        return stage

    async def _report(self, step: int, intake: StepIntake, row: StepRow) -> None:
        """The step's gauges, timeline event and log line."""
        LAST_WAIT_S.set(row.train_wait_s or 0.0)
        LOSS.set(row.policy_loss or 0.0)
        await timeline.emit(
            self.r,
            self.run_id,
            "trained",
            step=step,
            train_s=row.train_s,
            wait_s=row.train_wait_s,
            policy_loss=row.policy_loss,
        )
        log.info(
            "run %s step %d: trained %d groups in %.2fs (waited %.2fs after %.2fs of "
            "seeding), loss %.4f",
            self.run_id,
            step,
            intake.trained,
            row.train_s,
            row.train_wait_s,
            row.seed_wait_s,
            row.policy_loss,
        )

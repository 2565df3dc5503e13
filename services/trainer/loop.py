"""The trainer loop: take an active run (the oldest whose lease is free, or this trainer's
own: `state.trainer_pool`), build its policy and hand it to a `RunTrainer` (run_trainer.py),
which publishes its base weights as version 0 (or resumes it), trains its steps and publishes
each version; then wait for the coordinator to move on from that run. The lease is renewed
while the run trains; a trainer that lost it stops training the run. The trainer beats into
the pool's hash meanwhile, saying which run it trains.

What a run's trainer asks of a policy is `protocol.TrainablePolicy`; the policy is a Hugging
Face model (policy.py), sharded over the ranks when the trainer runs as several (ranks.py), or a
benchmark's stand-in (`policy_factory`).
"""

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.messages import Group
from services.contracts.runspec import RunSpec
from services.infra.cancel import cancel_and_wait
from services.infra.compute import compute
from services.infra.redis_failover import RedisFailedOver, fenced
from services.infra.redis_streams import StreamConsumer, ensure_group, with_reconnect
from services.state import run_record, trainer_pool
from services.state.run_state import RunStopped, active_runs
from services.trainer.checkpoint import Checkpoints
from services.trainer.protocol import TrainablePolicy
from services.trainer.run_trainer import RunTrainer
from services.trainer.settings import TrainerSettings
from services.trainer.versions import VersionPublisher, fail_run
from services.weights.transfer import WeightClient

log = logging.getLogger(__name__)
PolicyFactory = Callable[[Path, RunSpec, str], TrainablePolicy]  # (model folder, spec, device)


def default_policy(model_dir: Path, spec: RunSpec, device: str) -> TrainablePolicy:
    """The run's policy: a Hugging Face model (imported only when a run needs it), sharded over
    the ranks when the trainer runs as several (ranks.py)."""
    from services.trainer import ranks

    if ranks.world_size() > 1:
        return ranks.lead(model_dir, spec, device)
    from services.trainer.policy import Policy

    return Policy(model_dir, spec, device)


class TrainerLoop:
    """Finds the active run and trains it, one run at a time, for the life of the process."""

    def __init__(
        self,
        settings: TrainerSettings,
        r: aioredis.Redis,
        policy_factory: PolicyFactory | None = None,
    ) -> None:
        self.settings = settings
        # builds the policy of a run (model folder, spec, device); benchmarks pass a stand-in
        self.policy_factory = policy_factory or default_policy
        self.r = r
        self.weights = WeightClient(
            settings.weightstore_urls(),
            settings.outgoing_token(),
            ca_file=settings.tls_ca_file,
            deltas=settings.weight_deltas,
        )
        self.versions = VersionPublisher(
            r,
            self.weights,
            settings.work_dir,
            settings.redis_wait_replicas,
            settings.redis_wait_timeout_ms,
        )
        self.between_runs: dict = {"run_id": None, "step": None, "state": "idle"}
        self.run: RunTrainer | None = None  # the run being trained, or the last one
        self.trainer_id = settings.trainer_id
        self.training: str | None = None  # the run whose lease this trainer holds

    @property
    def status(self) -> dict:
        """Idle, loading a run, or the status of the run being trained (or the last one)."""
        return self.run.status if self.run is not None else self.between_runs

    async def forever(self) -> None:
        while True:
            run_id = await with_reconnect(self.take_run, "active runs")
            if run_id is None:
                self.run = None
                self.between_runs = {"run_id": None, "step": None, "state": "idle"}
                await asyncio.sleep(self.settings.poll_s)
                continue
            self.training = run_id
            # said at once: the coordinator activates another run only for an idle trainer
            await with_reconnect(
                partial(trainer_pool.beat, self.r, self.trainer_id, run_id), "beat"
            )
            try:
                with fenced(self.r):  # what a run's trainer holds is of one Redis primary
                    await self.train_holding(run_id)
            except RunStopped as exc:
                log.info("run %s stopped: %s", run_id, exc)
            except RedisFailedOver as exc:
                log.warning("run %s: %s; resuming it from what the new one holds", run_id, exc)
                continue  # taken again (this trainer holds its lease) and resumed
            finally:
                self.training = None
            await self.wait_moved_on(run_id)

    async def wait_moved_on(self, run_id: str) -> None:
        """Wait for the coordinator to move on from the run, holding its lease meanwhile (no
        other trainer takes a run that trained to its end)."""
        renewed = time.monotonic()
        while run_id in await with_reconnect(lambda: active_runs(self.r), "active runs"):
            if time.monotonic() - renewed >= trainer_pool.BEAT_S:
                await with_reconnect(
                    lambda: trainer_pool.renew(self.r, run_id, self.trainer_id), "lease"
                )
                renewed = time.monotonic()
            await asyncio.sleep(self.settings.poll_s)

    async def beat_forever(self) -> None:
        """Say in the pool's hash that this trainer is alive, and which run it trains."""
        while True:
            await with_reconnect(
                lambda: trainer_pool.beat(self.r, self.trainer_id, self.training), "beat"
            )
            await asyncio.sleep(trainer_pool.BEAT_S)

    async def take_run(self) -> str | None:
        """The oldest active run whose lease this trainer holds or could take, taken."""
        for run_id in await active_runs(self.r):
            if await trainer_pool.take(self.r, run_id, self.trainer_id):
                return run_id
        return None

    async def train_holding(self, run_id: str) -> None:
        """Train the run while renewing its lease; stop (RunStopped) if the lease was lost."""
        training = asyncio.create_task(self.train_run(run_id))
        try:
            while True:
                done, _ = await asyncio.wait({training}, timeout=trainer_pool.BEAT_S)
                if done:
                    return training.result()
                held = await with_reconnect(
                    lambda: trainer_pool.renew(self.r, run_id, self.trainer_id), "lease"
                )
                if not held:
                    raise RunStopped("its lease went to another trainer")
        finally:
            await cancel_and_wait([training])

    async def train_run(self, run_id: str) -> None:
        self.run = None
        self.run = await self.open_run(run_id)
        await self.run.train()

    async def open_run(self, run_id: str) -> RunTrainer:
        """The trainer of run `run_id`: its spec, its policy built, its groups consumer."""
        run = await run_record.read(self.r, run_id, "spec")
        if run is None:
            raise RunStopped("deleted")
        spec = run.run_spec()
        self.between_runs = {"run_id": run_id, "step": 0, "state": "loading"}
        try:
            policy = await compute(
                self.policy_factory, Path(spec.model), spec, self.settings.device
            )
        except ValueError as exc:  # the run asks what this trainer cannot do: it fails, said why
            await fail_run(self.r, run_id, f"its policy could not be built: {exc}")
        groups_stream = keys.groups_stream(run_id)
        await ensure_group(self.r, groups_stream, keys.TRAINER_GROUP)
        # first the groups read before a restart and never acknowledged, then new ones
        groups = StreamConsumer(
            self.r, groups_stream, keys.TRAINER_GROUP, "trainer", Group, replay=True
        )
        ckpts = Checkpoints(
            self.settings.work_dir / run_id / "checkpoints", self.settings.keep_checkpoints
        )
        return RunTrainer(self.settings, self.r, self.versions, run_id, spec, policy, groups, ckpts)

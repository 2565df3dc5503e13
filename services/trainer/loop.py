"""The trainer loop: find the active run, build its policy and hand it to a `RunTrainer`
(run_trainer.py), which publishes its base weights as version 0 (or resumes it), trains its
steps and publishes each version; then wait for the coordinator to move on to the next run.

What a run's trainer asks of a policy is `protocol.TrainablePolicy`; the policy is a Hugging
Face model (policy.py), sharded over the ranks when the trainer runs as several (ranks.py), or a
benchmark's stand-in (`policy_factory`).
"""

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.messages import Group
from services.contracts.runspec import RunSpec
from services.infra.compute import compute
from services.infra.redis_streams import StreamConsumer, ensure_group, with_reconnect
from services.state import run_record
from services.state.run_state import RunStopped, active_run
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
        self.versions = VersionPublisher(r, self.weights, settings.work_dir)
        self.between_runs: dict = {"run_id": None, "step": None, "state": "idle"}
        self.run: RunTrainer | None = None  # the run being trained, or the last one

    @property
    def status(self) -> dict:
        """Idle, loading a run, or the status of the run being trained (or the last one)."""
        return self.run.status if self.run is not None else self.between_runs

    async def forever(self) -> None:
        while True:
            run_id = await with_reconnect(lambda: active_run(self.r), "active run")
            if run_id is None:
                self.run = None
                self.between_runs = {"run_id": None, "step": None, "state": "idle"}
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

"""A trainer killed after it committed a step's version and retired the step's groups, before it
announced the version (publishing.py: commit, retire, record, announce): the groups are gone
from the stream, the version is in the store. The restarted trainer must announce that version
and go on from the step after, with the weights the store holds; it must not wait for groups
that will never come again (the run hung: a fresh-clone CI caught a SIGKILL in that window).

The state the kill leaves is made by the trainer's own code on a real Redis and a real weight
store: the first trainer's announcement is the only thing that does not happen.
"""

import asyncio

import pytest
import redis.asyncio as aioredis
import torch

from services.cli import procs
from services.contracts import keys
from services.contracts.runspec import RunSpec
from services.state import trainer_state
from services.state.run_state import committed_version
from services.state.runs import RunStore
from services.state.step_metrics import StepRow
from services.trainer.intake import StepIntake
from services.trainer.loop import TrainerLoop
from services.trainer.settings import TrainerSettings
from services.weights.files import hash_files
from tests.integration.conftest import small_spec, start_store

pytestmark = pytest.mark.slow


class KilledBeforeAnnouncing(Exception):
    """Stands for the SIGKILL: raised where the announcement would have been."""


@pytest.fixture
def services(tmp_path):
    redis_proc, redis_url = procs.start_redis(tmp_path / "logs", tmp_path / "redis")
    store = start_store(tmp_path / "store")
    yield redis_url, store.url
    store.stop()
    redis_proc.stop()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["no-checkpoint", "checkpointed"])
def test_a_version_committed_and_retired_but_not_announced_is_announced_on_resume(
    services, tmp_path, tiny_model, checkpointed
):
    redis_url, store_url = services
    settings = TrainerSettings(
        redis_url=redis_url,
        weightstore_url=store_url,
        work_dir=tmp_path / "trainer",
        checkpoint_every=1 if checkpointed else 1000,
    )

    async def scenario() -> None:
        r = aioredis.from_url(redis_url)
        spec = RunSpec.model_validate(small_spec(tiny_model, steps=3))
        run_id = await RunStore(r).submit(spec)

        first = await TrainerLoop(settings, r).open_run(run_id)
        assert await first._start() == 0  # v0 committed and announced
        # step 0 "trained": other weights than v0's, as an optimizer step makes
        with torch.no_grad():
            for p in first.policy.model.parameters():
                p.add_(0.01)
        intake = StepIntake(run_id, 0, spec.training.prompts_per_step, spec.training.group_size)
        if checkpointed:
            await first._checkpoint(1, intake)
            first.writer.close()

        async def killed(run_id: str, version: int) -> None:
            raise KilledBeforeAnnouncing

        first.versions.announce = killed
        with pytest.raises(KilledBeforeAnnouncing):
            await first.publisher.start(0, intake, StepRow(policy_loss=0.0), background=False)
        assert await committed_version(r, run_id) == 0
        assert (await trainer_state.read(r, run_id)).steps_trained == 1  # retired
        stored = await first.versions.weights.stored_digest(run_id, 1)
        assert stored is not None

        # the restarted trainer: a new process's objects, the same Redis, store and folders
        second = await TrainerLoop(settings, r).open_run(run_id)
        assert await asyncio.wait_for(second._start(), 120) == 1
        assert await committed_version(r, run_id) == 1
        assert await r.xlen(keys.version_announced(run_id)) == 1
        # it trains on from the very weights the workers pull as v1
        local = await hash_files(second.policy.export_files(1))
        assert local.digest == stored
        await r.aclose()

    asyncio.run(scenario())

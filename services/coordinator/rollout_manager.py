"""The rollout manager of one run: for each step, queue B x n token-level jobs on the stream of
the step's weight version, collect token deltas until every group is published to the trainer,
and record the step. The coordinator shard that drives it is the step's leader (shard 0,
`step_leader.py`) or a follower (shards 1..K-1, `step_follower.py`); what both do is
`step_shard.py`. `RunManager.configured` builds the right one from the coordinator's settings.

Redis holds what a restart can still need, no more: a delta entry is deleted in the transaction
that stores what it carried; a step's jobs and request table are deleted once the version
trained on it is committed.
"""

import redis.asyncio as aioredis

from services.contracts.runspec import RunSpec
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.shard_group import ShardProcesses
from services.coordinator.step_follower import StepFollower
from services.coordinator.step_leader import StepLeader
from services.coordinator.step_shard import StepShard
from services.coordinator.workers.keys import WorkerKeys


class RunManager:
    """Builds the manager of one coordinator shard of a run."""

    @staticmethod
    def configured(
        r: aioredis.Redis,
        run_id: str,
        spec: RunSpec,
        settings: CoordinatorSettings,
        shard: int = 0,
    ) -> StepShard:
        """The manager of shard `shard` of the run as the coordinator's settings say: shard 0
        leads (and with several shards starts the others), another follows."""
        manager = RunManager._built(r, run_id, spec, settings, shard)
        if settings.worker_redis_users:  # workers sign their deltas
            manager.worker_keys = WorkerKeys(r)
        return manager

    @staticmethod
    def _built(
        r: aioredis.Redis, run_id: str, spec: RunSpec, settings: CoordinatorSettings, shard: int
    ) -> StepShard:
        if shard != 0:
            return StepFollower(
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
            )
        shards = spec.rollout.coordinator_shards
        return StepLeader(
            r,
            run_id,
            spec,
            settings.stall_after_s,
            settings.redis_memory_limit_mb,
            settings.redis_memory_high,
            reward_modules=settings.reward_modules,
            reward_processes=settings.reward_processes,
            limits=settings.dataset_limits(),
            shard_processes=ShardProcesses(run_id, shards, settings) if shards > 1 else None,
            environments=settings.environment_limits(),
        )

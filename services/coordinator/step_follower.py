"""A shard follower: coordinator shard i > 0 of a run (`contracts.shards`), a process of its own
(`shard.py`). It does its share of every step (`step_shard.py`: queue its jobs, collect its
deltas, publish its groups) and reports to the leader (shard 0) through `ShardView`: how many of
its requests are unfinished while the step runs, its summary once its groups are published.

It decides nothing that is the whole step's: no seeding, balancing, reclaiming, stall watch or
step record (the leader's, `step_leader.py`).
"""

import time

from services.coordinator.open_step import OpenStep, StepDone
from services.coordinator.shard_group import ShardView
from services.coordinator.step_shard import JOBS_TTL_S, StepShard


class StepFollower(StepShard):
    async def _drive_step(self, step: OpenStep) -> StepDone:
        """Until its groups of the step are published, report how many of its requests are
        unfinished; then its summary."""
        table, store = step.live.table, step.live.store
        others = ShardView(self.r, self.run_id, table.step, self.shards)
        while not await self._until_change(step.live, others, all_shards=False):
            await others.report_unfinished(self.shard, table.unfinished_count)
        # complete: its last deltas are applied and stored; later ones of it are dropped
        self.live.pop(table.step, None)
        summary = step.live.summary()
        await store.expire_soon(JOBS_TTL_S)
        await others.report_done(self.shard, summary)
        return StepDone(table.step, step.times(time.monotonic()), tuple(store.scratch_keys()))

"""What a step leaves on record: once its rollout is over, its metrics row (rollout fields), the
rollout gauges and a `rollout_done` event; once the trainer committed the next version, the
seeding update (`core.seeding.after_step`: T_seed moved, N_prem worked out) in its row and in
the run's hash.

It does not decide anything itself: the update comes from `core.seeding`, the figures from the
step's request table and times.
"""

import json
import logging
import math
import time
from dataclasses import replace

import redis.asyncio as aioredis
from prometheus_client import Gauge, Histogram

from services.common import keys, timeline
from services.common.step_metrics import StepRow, read_step, record_step
from services.coordinator.memory import RedisMemory, run_streams, stream_lengths
from services.core.request_table import Applied, RequestTable
from services.core.seeding import (
    PoolSizer,
    SeedingController,
    StepTimes,
    after_step,
    train_compute_s,
)

log = logging.getLogger(__name__)
ROLLOUT_S = Histogram(
    "spotrl_coordinator_rollout_seconds",
    "Rollout time of a step",
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
)
N_PREM = Gauge("spotrl_coordinator_n_prem_recommended", "Preemptible pool size worth having")
WANTED = Gauge(
    "spotrl_coordinator_preemptible_wanted", "Preemptible workers a scaler should hold (0: all)"
)
REWARD = Gauge("spotrl_coordinator_reward_mean", "Mean reward of the newest rollout step")
STEP_TOK_S = Gauge(
    "spotrl_coordinator_step_tokens_per_second", "Rollout tokens/s of the newest step (all pools)"
)


async def record_rollout(
    r: aioredis.Redis,
    run_id: str,
    table: RequestTable,
    times: StepTimes,
    window: float,
    pools: dict[str, int],
    reward_errors: int = 0,
) -> None:
    """The step's rollout is over: its metrics row, gauges, event and log line.
    `reward_errors`: its reward calls that failed and scored 0."""
    step = table.step
    rollout_s = times.rollout_end - times.started
    ROLLOUT_S.observe(rollout_s)
    tokens = table.response_tokens
    mean_reward = table.mean_reward()
    seed_end = times.seed_end if times.seed_end is not None else times.rollout_end
    await record_step(
        r,
        run_id,
        step,
        StepRow(
            version=table.version,
            reward_mean=mean_reward,
            response_tokens=tokens,
            response_len_mean=tokens / len(table.requests),
            rollout_s=rollout_s,
            tokens_per_s=tokens / max(rollout_s, 1e-9),
            stale_deltas=table.stats[Applied.STALE_LEASE.value],
            tokens_received=table.tokens_received,
            tokens_discarded=table.tokens_discarded,
            regenerated_tokens=table.tokens_received - tokens,
            migrations=dict(table.migrations),
            t_seed_s=window,  # inf (no window) is stored as null
            seed_s=seed_end - times.started,
            workers_reserved=pools["reserved"],
            workers_preemptible=pools["preemptible"],
            groups_quarantined=len(table.quarantined),
            reward_errors=reward_errors,
            redis_mem_mib=round((await RedisMemory(r).read()).used_mib, 1),
            stream_lengths=await stream_lengths(r, run_streams(run_id, step)),
        ),
    )
    REWARD.set(mean_reward)
    STEP_TOK_S.set(tokens / max(rollout_s, 1e-9))
    await timeline.emit(
        r,
        run_id,
        "rollout_done",
        step=step,
        reward_mean=mean_reward,
        tokens=tokens,
        rollout_s=rollout_s,
        reward_errors=reward_errors,
    )
    log.info(
        "step %d: rollout done in %.2fs, %d tokens, reward %.3f (%d reward errors)",
        step,
        rollout_s,
        tokens,
        mean_reward,
        reward_errors,
    )


async def adapt(
    r: aioredis.Redis,
    run_id: str,
    seeding: SeedingController,
    pool: PoolSizer,
    step: int,
    times: StepTimes,
) -> None:
    """After the trainer committed the version trained on `step` (whose rollout took `times`):
    move T_seed (Algorithm 1), work out the preemptible pool size worth having and the pool a
    scaler should hold (`preemptible_wanted`)."""
    trained = await read_step(r, run_id, step)
    train_wait_s = trained.train_wait_s or 0.0
    compute_s = train_compute_s(trained.train_s or 0.0, train_wait_s, trained.seed_wait_s or 0.0)
    times = replace(
        times,
        committed=time.monotonic(),
        train_compute_s=compute_s,
        train_wait_s=train_wait_s,
    )
    update = after_step(seeding, times)
    n_prem = None if math.isinf(update.n_prem_recommended) else update.n_prem_recommended
    row = StepRow(
        t_remote_wait_s=update.t_remote_wait_s,
        t_seed_next_s=update.t_seed_next_s,
        n_prem_recommended=update.n_prem_recommended,
    )
    await record_step(r, run_id, step, row)
    wanted = pool.after_step(update.n_prem_recommended)
    await r.hset(
        keys.run(run_id),
        mapping={
            "t_seed_s": update.t_seed_next_s,
            "n_prem_recommended": json.dumps(n_prem),
            "preemptible_wanted": json.dumps(wanted),
        },
    )
    N_PREM.set(n_prem or 0)
    WANTED.set(wanted or 0)

"""Per-step metrics rows of a run, written by several services into one Redis hash per step.

The coordinator writes the rollout fields and the trainer the training fields of the same row;
values are JSON so that numbers keep their type.
"""

import json

import redis.asyncio as aioredis

from services.common import keys


async def record_step(r: aioredis.Redis, run_id: str, step: int, fields: dict) -> None:
    async with r.pipeline(transaction=True) as pipe:
        pipe.hset(
            keys.run_step(run_id, step), mapping={k: json.dumps(v) for k, v in fields.items()}
        )
        pipe.zadd(keys.run_steps_done(run_id), {str(step): step})
        await pipe.execute()


async def read_steps(r: aioredis.Redis, run_id: str) -> list[dict]:
    steps = [int(s) for s in await r.zrange(keys.run_steps_done(run_id), 0, -1)]
    rows = []
    for step in steps:
        raw = await r.hgetall(keys.run_step(run_id, step))
        rows.append({"step": step, **{k.decode(): json.loads(v) for k, v in raw.items()}})
    return rows

"""The trainer pool in Redis: which trainer trains which active run.

Each trainer beats into a key with a TTL (keys.trainer_heartbeat: the run it trains, or none)
and is listed once in keys.TRAINERS, so the coordinator knows how many are idle: it activates a
second run, and more, only for an idle trainer (`RunStore.activate_next`). A trainer takes an
active run by its lease (keys.run_trainer_lease): set if free, renewed while it trains and until
the coordinator moves on from the run (the lease goes with the run's keys). A trainer that dies
leaves its lease to lapse, and any trainer of the pool takes the run then and resumes it from
its checkpoint; its own restart (the same id) takes it back at once. A trainer that finds it
lost its lease stops training that run: two never train one.
"""

import json
from typing import cast

import redis.asyncio as aioredis

from services.contracts import keys

BEAT_S = 1.0  # a trainer beats this often
ALIVE_MS = 5000  # a trainer whose last beat is older than this counts as gone
LEASE_S = 15.0  # a run's lease lapses this long after its trainer last renewed it

# the lease's value is the trainer's id: renewed only by that trainer
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


async def beat(r: aioredis.Redis, trainer_id: str, run_id: str | None) -> None:
    """The trainer is alive, training `run_id` (None: idle)."""
    async with r.pipeline(transaction=False) as pipe:
        pipe.sadd(keys.TRAINERS, trainer_id)
        pipe.set(keys.trainer_heartbeat(trainer_id), json.dumps({"run_id": run_id}), px=ALIVE_MS)
        await pipe.execute()


async def idle_trainers(r: aioredis.Redis) -> int:
    """How many trainers beat within ALIVE_MS and train no run."""
    ids = sorted(x.decode() for x in cast(set[bytes], await r.smembers(keys.TRAINERS)))
    if not ids:
        return 0
    beats = cast(list[bytes | None], await r.mget([keys.trainer_heartbeat(t) for t in ids]))
    idle = 0
    for raw in beats:
        if raw is None:
            continue  # gone quiet: gone
        try:
            said = json.loads(raw)
        except ValueError:
            continue  # not a beat of ours: no trainer counted
        if isinstance(said, dict) and said.get("run_id") is None:
            idle += 1
    return idle


async def take(r: aioredis.Redis, run_id: str, trainer_id: str) -> bool:
    """Take the run's lease if it is free or this trainer's already; whether it is ours."""
    lease = keys.run_trainer_lease(run_id)
    if await r.set(lease, trainer_id, nx=True, px=int(LEASE_S * 1000)):
        return True
    return await renew(r, run_id, trainer_id)


async def renew(r: aioredis.Redis, run_id: str, trainer_id: str) -> bool:
    """Renew the run's lease if this trainer holds it; whether it does."""
    lease = keys.run_trainer_lease(run_id)
    return bool(await r.eval(_RENEW, 1, lease, trainer_id, int(LEASE_S * 1000)))

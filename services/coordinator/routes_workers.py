"""/v1/workers: rollout workers register here; everyone can list them with their liveness."""

import time

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends

from services.common import keys
from services.common.messages import Heartbeat, MalformedMessage
from services.coordinator.schemas import WorkerCreate, WorkerPublic


def build_router(r: aioredis.Redis, write_guard) -> APIRouter:
    router = APIRouter(prefix="/v1/workers", tags=["workers"])

    @router.post(
        "", status_code=201, response_model=WorkerPublic, dependencies=[Depends(write_guard)]
    )
    async def register(worker: WorkerCreate) -> WorkerPublic:
        async with r.pipeline(transaction=True) as pipe:
            pipe.hset(
                keys.worker(worker.id),
                mapping={**worker.model_dump(), "registered_at": time.time()},
            )
            pipe.sadd(keys.WORKER_INDEX, worker.id)
            await pipe.execute()
        return WorkerPublic(**worker.model_dump(), alive=False)

    @router.get("", response_model=list[WorkerPublic])
    async def list_workers(alive: bool | None = None) -> list[WorkerPublic]:
        out = []
        for raw_id in sorted(await r.smembers(keys.WORKER_INDEX)):
            worker_id = raw_id.decode()
            info = {
                k.decode(): v.decode() for k, v in (await r.hgetall(keys.worker(worker_id))).items()
            }
            if not info:
                continue
            beat_raw = await r.get(keys.worker_heartbeat(worker_id))
            beat = None
            if beat_raw is not None:
                try:
                    beat = Heartbeat.decode(beat_raw)
                except MalformedMessage:
                    beat = None
            item = WorkerPublic(
                id=worker_id,
                pool=info["pool"],
                engine=info["engine"],
                slots=int(info["slots"]),
                url=info.get("url", ""),
                alive=beat is not None,
                run_id=beat.run_id if beat else None,
                version=beat.version if beat else None,
                active=beat.active if beat else 0,
                tokens_generated=beat.tokens_generated if beat else 0,
            )
            if alive is None or item.alive == alive:
                out.append(item)
        return out

    return router

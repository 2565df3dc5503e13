"""/v1/workers: rollout workers register here; operators list them with their liveness (from the
read model), order one to give work back, and forget workers that are gone."""

import time
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import APIRouter, HTTPException, Path, Request, Response

from services.contracts import keys
from services.contracts.messages import WorkerControl
from services.contracts.records import WorkerRecord
from services.coordinator.read_model import ReadModel
from services.coordinator.scheduling import heartbeats, order
from services.coordinator.schemas import WorkerCreate, WorkerOrdered, WorkerPublic, WorkerRelease
from services.infra.read_limit import NOT_MODIFIED, revalidated
from services.infra.service import Auth, errors
from services.state import worker_record

WorkerId = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")]


def build_router(r: aioredis.Redis, model: ReadModel, auth: Auth) -> APIRouter:
    router = APIRouter(prefix="/v1/workers", tags=["workers"])
    change = {**auth.write_errors, **errors(400, 404, 409, 413)}

    @router.post(
        "",
        status_code=201,
        response_model=WorkerPublic,
        dependencies=auth.write,
        responses={**auth.write_errors, **errors(400, 413)},
    )
    async def register(worker: WorkerCreate) -> WorkerPublic:
        record = WorkerRecord(**worker.model_dump(), registered_at=time.time())
        async with r.pipeline(transaction=True) as pipe:
            worker_record.stage_register(pipe, record)
            pipe.sadd(keys.WORKER_INDEX, worker.id)
            pipe.delete(keys.worker_leaving(worker.id))  # a new incarnation
            await pipe.execute()
        return WorkerPublic(**worker.model_dump(), alive=False)

    @router.get(
        "",
        response_model=list[WorkerPublic],
        dependencies=auth.read,
        responses={**auth.read_errors, **NOT_MODIFIED, **errors(429, 503)},
    )
    async def list_workers(request: Request, alive: bool | None = None) -> Response:
        if not model.fresh:
            raise HTTPException(503, "redis unavailable", {"Retry-After": "2"})
        doc = model.workers[alive]
        return revalidated(request, doc.body, doc.etag)

    @router.post(
        "/{worker_id}/release",
        status_code=202,
        response_model=WorkerOrdered,
        dependencies=auth.write,
        responses=change,
    )
    async def release(worker_id: WorkerId, body: WorkerRelease) -> WorkerOrdered:
        """Order an alive worker to give `count` executing requests back; they continue on other
        workers from the tokens already generated (a migration with cause "release")."""
        if not await r.exists(keys.worker(worker_id)):
            raise HTTPException(404, f"worker {worker_id} is not registered")
        beat = (await heartbeats(r)).get(worker_id)
        if beat is None or beat.run_id is None:
            raise HTTPException(409, f"worker {worker_id} is not alive on a run")
        control = WorkerControl(action="release", run_id=beat.run_id, count=body.count)
        await order(r, worker_id, control)
        return WorkerOrdered(
            worker_id=worker_id, run_id=beat.run_id, action="release", count=body.count
        )

    @router.delete("/{worker_id}", status_code=204, dependencies=auth.write, responses=change)
    async def forget(worker_id: WorkerId) -> Response:
        """Remove a worker that is gone from the list (an alive one: 409)."""
        if not await r.exists(keys.worker(worker_id)):
            raise HTTPException(404, f"worker {worker_id} is not registered")
        if await r.exists(keys.worker_heartbeat(worker_id)):
            raise HTTPException(409, f"worker {worker_id} is alive")
        async with r.pipeline(transaction=True) as pipe:
            pipe.delete(keys.worker(worker_id), keys.worker_control(worker_id))
            pipe.srem(keys.WORKER_INDEX, worker_id)
            await pipe.execute()
        return Response(status_code=204)

    return router

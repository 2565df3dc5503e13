"""/v1/workers: rollout workers register here; operators list them with their liveness (from the
read model), order one to give work back, and forget workers that are gone."""

import contextlib
import hmac
import time
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import APIRouter, HTTPException, Path, Request, Response

from services.contracts import keys
from services.contracts.consumers import jobs_consumer
from services.contracts.messages import WorkerControl
from services.contracts.records import WorkerRecord
from services.coordinator.read_model import ReadModel
from services.coordinator.scheduling import heartbeats, order
from services.coordinator.schemas import (
    WorkerCreate,
    WorkerOrdered,
    WorkerPublic,
    WorkerRegistered,
    WorkerRegistration,
    WorkerRelease,
)
from services.coordinator.worker_keys import COORDINATOR
from services.infra.read_limit import NOT_MODIFIED, revalidated
from services.infra.redis_streams import text
from services.infra.redis_users import drop_worker_user, mint_worker_user
from services.infra.service import Auth, errors
from services.infra.signing import consumer_secret, key_bytes, new_key, registration_proof
from services.state import worker_record

WorkerId = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")]


def build_router(
    r: aioredis.Redis, model: ReadModel, auth: Auth, mint_users: bool = False
) -> APIRouter:
    """With `mint_users` (the setting `worker_redis_users`), a worker registering gets its own
    Redis user and a key to sign its delta batches with, new at each registration (a restart);
    forgetting a worker drops both."""
    router = APIRouter(prefix="/v1/workers", tags=["workers"])
    admin, worker, read = auth.need("admin"), auth.need("worker"), auth.need("read")
    change = {**admin.responses, **errors(400, 404, 409, 413)}

    @router.post(
        "",
        status_code=201,
        response_model=WorkerRegistered,
        dependencies=worker.dependencies,
        responses={**worker.responses, **errors(400, 413)},
    )
    async def register(registration: WorkerRegistration) -> WorkerRegistered:
        worker = WorkerCreate(**registration.model_dump(exclude={"proof"}))
        record = WorkerRecord(**worker.model_dump(), registered_at=time.time())
        minted: dict[str, str] = {}
        if mint_users:  # the key is stored before the worker can write anything with it
            kept = await check_alive_registration(r, worker.id, registration.proof)
            minted["consumer"] = jobs_consumer(worker.id, await consumer_secret_of(worker.id))
            # the same key to an alive worker registering again: a batch it signed just before
            # still checks out (a parked one would leave a gap in its requests)
            minted["signing_key"] = kept or new_key()
            try:
                username, password = await mint_worker_user(r, worker.id)
            except ValueError as exc:  # an id that cannot name a Redis user
                raise HTTPException(400, str(exc)) from exc
            minted.update(redis_username=username, redis_password=password)
        async with r.pipeline(transaction=True) as pipe:
            worker_record.stage_register(pipe, record)
            pipe.sadd(keys.WORKER_INDEX, worker.id)
            pipe.delete(keys.worker_leaving(worker.id))  # a new incarnation
            if mint_users:
                pipe.hset(keys.WORKER_KEYS, worker.id, minted["signing_key"])
            await pipe.execute()
        return WorkerRegistered(**worker.model_dump(), alive=False, **minted)

    @router.get(
        "",
        response_model=list[WorkerPublic],
        dependencies=read.dependencies,
        responses={**read.responses, **NOT_MODIFIED, **errors(429, 503)},
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
        dependencies=admin.dependencies,
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

    @router.delete(
        "/{worker_id}", status_code=204, dependencies=admin.dependencies, responses=change
    )
    async def forget(worker_id: WorkerId) -> Response:
        """Remove a worker that is gone from the list (an alive one: 409), with its own Redis
        user and signing key where workers get them."""
        if not await r.exists(keys.worker(worker_id)):
            raise HTTPException(404, f"worker {worker_id} is not registered")
        if await r.exists(keys.worker_heartbeat(worker_id)):
            raise HTTPException(409, f"worker {worker_id} is alive")
        async with r.pipeline(transaction=True) as pipe:
            pipe.delete(keys.worker(worker_id), keys.worker_control(worker_id))
            pipe.srem(keys.WORKER_INDEX, worker_id)
            if mint_users:
                pipe.hdel(keys.WORKER_KEYS, worker_id)
            await pipe.execute()
        if mint_users:
            with contextlib.suppress(ValueError):  # an id that never could have a user
                await drop_worker_user(r, worker_id)
        return Response(status_code=204)

    async def consumer_secret_of(worker_id: str) -> str:
        """The secret of the worker's jobs consumer name, under the coordinator's own key (made
        by the first coordinator process that needs it)."""
        await r.hsetnx(keys.WORKER_KEYS, COORDINATOR, new_key())
        coordinator_key = await r.hget(keys.WORKER_KEYS, COORDINATOR)
        if not coordinator_key:  # deleted in between: the worker's retry makes it again
            raise HTTPException(503, "the coordinator's key is being made", {"Retry-After": "1"})
        return consumer_secret(key_bytes(coordinator_key), worker_id)

    return router


async def check_alive_registration(
    r: aioredis.Redis, worker_id: str, proof: str | None
) -> str | None:
    """A worker id that is alive registers again only with the proof that it holds the id's
    current key (its jobs task restarted): anyone else with the worker token would take over
    its user, its key and its consumer name. 409 otherwise: a new process under that id waits
    for the old one's heartbeat to expire. The key it keeps (hex), or None: not alive."""
    if not await r.exists(keys.worker_heartbeat(worker_id)):
        return None
    current = text(await r.hget(keys.WORKER_KEYS, worker_id))
    if current and proof and registration_matches(key_bytes(current), worker_id, proof):
        return current
    raise HTTPException(
        409,
        f"worker {worker_id} is alive: registering it again needs its current key's proof "
        "(a new process under its id registers once its heartbeat expires)",
    )


def registration_matches(key: bytes, worker_id: str, proof: str) -> bool:
    return hmac.compare_digest(registration_proof(key, worker_id), proof)

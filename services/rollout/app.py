"""Rollout worker service: the worker's tasks plus health, metrics and status over HTTP.
The lifespan starts the tasks and, on SIGTERM (the preemption notice), releases what the
worker holds before it goes. It holds no worker logic: that is `worker.py` and its parts."""

import asyncio
import importlib
import logging
import time
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
import torch
from fastapi import FastAPI

from services.common import keys
from services.common.gpu import bound_gpu_memory
from services.common.http_limits import guard_input
from services.common.redis_streams import connect
from services.common.service import BackgroundTasks, add_health_and_metrics, auth_for
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker

log = logging.getLogger(__name__)
LEAVING_TTL_S = 600


async def import_engine_libraries(settings: RolloutSettings) -> None:
    """Import the engine's libraries before reporting healthy, so that the first weight load
    after joining a run is quick (and a missing vLLM is a clear error now)."""
    await asyncio.to_thread(importlib.import_module, "transformers")
    if settings.engine == "vllm":
        from services.rollout.engines.vllm import import_vllm

        await asyncio.to_thread(import_vllm)


async def leave_with_notice(
    worker: RolloutWorker, r: aioredis.Redis, settings: RolloutSettings
) -> None:
    """Release everything held within the grace period, say "left with notice", then go."""
    try:
        async with asyncio.timeout(settings.preempt_grace_s):  # not wait_for: common/cancel.py
            released = await worker.release_all()
        log.info("preemption notice: released %d requests", released)
    except TimeoutError:
        log.error(
            "could not release within %.0fs; the coordinator will reclaim by heartbeat",
            settings.preempt_grace_s,
        )
    if worker.loader.peers is not None:
        await worker.loader.peers.withdraw(r)
    # Say "left with notice" before the heartbeat goes, so nobody counts it as a loss.
    await r.set(keys.worker_leaving(settings.worker_id), time.time(), ex=LEAVING_TTL_S)
    await r.delete(keys.worker_heartbeat(settings.worker_id))
    await r.aclose()
    await worker.engine.close()


def build_app(settings: RolloutSettings) -> FastAPI:
    torch.set_num_threads(settings.torch_threads)
    bound_gpu_memory(settings.gpu_memory_share, settings.device)  # before the first allocation
    tasks = BackgroundTasks()
    r = connect(settings.redis_url)
    worker = RolloutWorker(settings, r)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await import_engine_libraries(settings)
        tasks.start("jobs", lambda: worker.reporting_crash(worker.jobs_forever))
        tasks.start("generate", lambda: worker.reporting_crash(worker.generate_forever, True))
        tasks.start("heartbeat", worker.heartbeat_forever)
        yield
        # SIGTERM is the preemption notice: stop taking jobs, release everything held, go.
        await tasks.stop()
        await leave_with_notice(worker, r, settings)

    app = FastAPI(title="spotrl rollout worker", version="1", lifespan=lifespan)
    auth = auth_for(settings)
    add_health_and_metrics(app, "rollout", tasks, extra=worker.status, auth=auth)
    guard_input(app, settings.api_token, settings.max_body_bytes)

    @app.get("/v1/status", dependencies=auth.read, responses=auth.read_errors)
    async def status() -> dict:
        return worker.status()

    return app

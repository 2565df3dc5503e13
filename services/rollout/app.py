"""Rollout worker service: the worker's tasks plus health, metrics and status over HTTP."""

import asyncio
import importlib
import logging
import time
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI

from services.common import keys
from services.common.http_limits import guard_input
from services.common.redis_streams import connect
from services.common.service import BackgroundTasks, add_health_and_metrics, auth_for
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker

log = logging.getLogger(__name__)
LEAVING_TTL_S = 600


def build_app(settings: RolloutSettings) -> FastAPI:
    torch.set_num_threads(settings.torch_threads)
    tasks = BackgroundTasks()
    r = connect(settings.redis_url)
    worker = RolloutWorker(settings, r)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Import the engine's libraries before reporting healthy, so that the first weight
        # load after joining a run is quick.
        await asyncio.to_thread(importlib.import_module, "transformers")
        if settings.engine == "vllm":
            from services.rollout.vllm_engine import import_vllm

            await asyncio.to_thread(import_vllm)  # a clear error now if it is not installed
        tasks.start("jobs", lambda: worker.reporting_crash(worker.jobs_forever))
        tasks.start("generate", lambda: worker.reporting_crash(worker.generate_forever, True))
        tasks.start("heartbeat", worker.heartbeat_forever)
        yield
        # SIGTERM is the preemption notice: stop taking jobs, release everything held, go.
        await tasks.stop()
        try:
            released = await asyncio.wait_for(worker.release_all(), settings.preempt_grace_s)
            log.info("preemption notice: released %d requests", released)
        except TimeoutError:
            log.error(
                "could not release within %.0fs; the coordinator will reclaim by heartbeat",
                settings.preempt_grace_s,
            )
        # Say "left with notice" before the heartbeat goes, so nobody counts it as a loss.
        await r.set(keys.worker_leaving(settings.worker_id), time.time(), ex=LEAVING_TTL_S)
        await r.delete(keys.worker_heartbeat(settings.worker_id))
        await r.aclose()
        await worker.engine.close()

    app = FastAPI(title="spotrl rollout worker", version="1", lifespan=lifespan)
    auth = auth_for(settings)
    add_health_and_metrics(app, "rollout", tasks, extra=worker.status, auth=auth)
    guard_input(app, settings.api_token, settings.max_body_bytes)

    @app.get("/v1/status", dependencies=auth.read, responses=auth.read_errors)
    async def status() -> dict:
        return worker.status()

    return app

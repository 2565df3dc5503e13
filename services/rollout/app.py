"""Rollout worker service: the worker's tasks plus health, metrics and status over HTTP.
The lifespan starts the tasks and, on SIGTERM (the preemption notice, or a cloud's notice that
`notice.NoticeWatcher` turns into one), releases what the worker holds before it goes, all of
it within the grace period (`services.rollout.grace`). It holds no worker logic: that is
`worker.py` and its parts."""

import asyncio
import importlib
import logging
import time
from collections.abc import Coroutine
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
import torch
from fastapi import FastAPI

from services.contracts import keys
from services.infra.cancel import cancel_and_wait
from services.infra.gpu import bound_gpu_memory
from services.infra.http_limits import guard_input
from services.infra.redis_streams import connect
from services.infra.retry import brief
from services.infra.service import BackgroundTasks, add_health_and_metrics, auth_for, tokens_of
from services.rollout.grace import LeavingPlan, plan_leaving
from services.rollout.notice import NoticeWatcher
from services.rollout.redis_login import RedisLogin
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker

log = logging.getLogger(__name__)
LEAVING_TTL_S = 600
CUT_SHORT_WAIT_S = 0.2  # a step cut short at its deadline gets this long to end


async def import_engine_libraries(settings: RolloutSettings) -> None:
    """Import the engine's libraries before reporting healthy, so that the first weight load
    after joining a run is quick (and a missing vLLM is a clear error now)."""
    await asyncio.to_thread(importlib.import_module, "transformers")
    if settings.engine == "vllm":
        from services.rollout.engines.vllm import import_vllm

        await asyncio.to_thread(import_vllm)


async def within(what: str, step: Coroutine[Any, Any, object], deadline: float) -> bool:
    """Run one step of leaving until `deadline` (the loop's clock); past it, cancel it and go
    on. A step that fails is logged and leaving goes on too. True when it completed.
    A task and `cancel_and_wait`, not `asyncio.timeout`: redis-py can lose one cancellation
    (infra/cancel.py), and the leaving must end whatever the step does."""
    task = asyncio.create_task(step, name=f"leaving: {what}")
    left_s = max(0.0, deadline - asyncio.get_running_loop().time())
    done, _ = await asyncio.wait({task}, timeout=left_s)
    if not done:
        stuck = await cancel_and_wait([task], CUT_SHORT_WAIT_S)
        log.error("%s: cut short at its deadline%s", what, " (would not stop)" if stuck else "")
        return False
    exc = task.exception()
    if exc is not None:
        log.error("%s failed: %s: %s", what, type(exc).__name__, brief(exc))
        return False
    return True


async def leave_with_notice(
    worker: RolloutWorker,
    r: aioredis.Redis,
    settings: RolloutSettings,
    plan: LeavingPlan,
    noticed_at: float,
) -> None:
    """Release everything held, say "left with notice" (when the notice came: `noticed_at`,
    unix seconds), close Redis and the engine; each step ends by its deadline in `plan`, Redis
    reachable or not."""

    async def release() -> None:
        released = await worker.release_all()
        log.info("preemption notice: released %d requests", released)

    if not await within("release", release(), plan.released_by):
        log.error("could not release what it holds; the coordinator will reclaim by heartbeat")

    async def farewell() -> None:
        # Say "left with notice" before the heartbeat goes, so nobody counts it as a loss.
        await r.set(keys.worker_leaving(settings.worker_id), noticed_at, ex=LEAVING_TTL_S)
        await r.delete(keys.worker_heartbeat(settings.worker_id))
        if worker.peers is not None:
            await worker.peers.withdraw(r)

    await asyncio.gather(
        within("farewell to redis", farewell(), plan.gone_by),
        within("close the engine", worker.engine.close(), plan.gone_by),
    )
    await within("close redis", r.aclose(), plan.gone_by)


def build_app(settings: RolloutSettings) -> FastAPI:
    torch.set_num_threads(settings.torch_threads)
    bound_gpu_memory(settings.gpu_memory_share, settings.device)  # before the first allocation
    tasks = BackgroundTasks()
    # no connection logs in before the worker registered: the coordinator may answer a Redis
    # user of the worker's own (`redis_login`)
    login = RedisLogin()
    r = login.attach(connect(settings.redis_url, ca_file=settings.tls_ca_file))
    worker = RolloutWorker(settings, r, login=login)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await import_engine_libraries(settings)
        tasks.start("jobs", lambda: worker.reporting_crash(worker.jobs_forever))
        tasks.start("generate", lambda: worker.reporting_crash(worker.generate_forever, True))
        tasks.start("heartbeat", worker.heartbeat_forever)
        if settings.cloud_notice != "off":
            tasks.start("cloud-notice", NoticeWatcher(settings).run_forever)
        yield
        # SIGTERM is the preemption notice: stop taking jobs, release everything held, go,
        # within the grace period as a whole.
        loop, noticed_at = asyncio.get_running_loop(), time.time()
        plan = plan_leaving(settings.preempt_grace_s, loop.time())
        await tasks.stop(max(0.0, plan.tasks_stopped_by - loop.time()))
        login.as_configured()  # never registered: say farewell as configured, as before
        await leave_with_notice(worker, r, settings, plan, noticed_at)

    app = FastAPI(title="spotrl rollout worker", version="1", lifespan=lifespan)
    auth = auth_for(settings)
    add_health_and_metrics(app, "rollout", tasks, extra=worker.status, auth=auth)
    guard_input(app, tokens_of(settings), settings.max_body_bytes)

    read = auth.need("read")

    @app.get("/v1/status", dependencies=read.dependencies, responses=read.responses)
    async def status() -> dict:
        return worker.status()

    return app

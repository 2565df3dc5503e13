"""Trainer service: the training loop as a background task, plus health, metrics and status."""

from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI

from services.infra.gpu import bound_gpu_memory
from services.infra.http_limits import guard_input
from services.infra.redis_streams import connect
from services.infra.service import BackgroundTasks, add_health_and_metrics, auth_for, tokens_of
from services.trainer import ranks
from services.trainer.loop import TrainerLoop
from services.trainer.settings import TrainerSettings


def build_app(settings: TrainerSettings) -> FastAPI:
    torch.set_num_threads(settings.torch_threads)
    bound_gpu_memory(settings.gpu_memory_share, settings.device)  # before the first allocation
    tasks = BackgroundTasks()
    r = connect(settings.redis_url, ca_file=settings.tls_ca_file)
    loop = TrainerLoop(settings, r)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks.start("trainer", loop.forever)
        tasks.start("pool beat", loop.beat_forever)
        yield
        await tasks.stop()  # a run's checkpoint at exit, with every rank
        ranks.release()  # uvicorn re-raises the SIGTERM once this returns: no later chance
        await r.aclose()

    app = FastAPI(title="spotrl trainer", version="1", lifespan=lifespan)
    auth = auth_for(settings)
    add_health_and_metrics(app, "trainer", tasks, extra=lambda: {"status": loop.status}, auth=auth)
    guard_input(app, tokens_of(settings), settings.max_body_bytes)

    read = auth.need("read")

    @app.get("/v1/status", dependencies=read.dependencies, responses=read.responses)
    async def status() -> dict:
        return {**loop.status, "ranks": ranks.world_size(), "device": settings.device}

    return app

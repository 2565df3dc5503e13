"""Coordinator: the control plane. The REST API for runs and workers, the dashboard and the
metrics (`api`), answered from the read model (`api.read_model`), in this process; the
scheduler, the runs' step loops and the observer run in the data plane (`run.data_plane`), a child
process this one starts, so that no read runs on the event loop that ingests token deltas.

Reads (GET) are limited per client (`read_rate_per_s`, `read_burst`: 429 past them) and carry an
ETag (304 to a poller that has the answer). Writes go to Redis with their checks, as before.
"""

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.coordinator.api.read_model import ReadModel
from services.coordinator.api.routes import (
    add_dashboard,
    fleet_router,
    runs_router,
    workers_router,
)
from services.coordinator.run.data_plane import DataPlaneProcess
from services.coordinator.settings import CoordinatorSettings
from services.infra.http_limits import guard_input
from services.infra.rate_limit import ClientBuckets
from services.infra.read_limit import ReadLimit
from services.infra.redis_streams import connect
from services.infra.retry import brief
from services.infra.service import BackgroundTasks, add_health_and_metrics, auth_for, tokens_of
from services.state.runs import RunStore

log = logging.getLogger(__name__)


class CountedBuckets(ClientBuckets):
    """Per-client read budgets that count the reads they refuse."""

    def __init__(self, settings: CoordinatorSettings, refused: Counter) -> None:
        super().__init__(settings.read_rate_per_s, settings.read_burst)
        self.refused = refused

    def take(self, client: str, now: float) -> float:
        wait_s = super().take(client, now)
        if wait_s > 0:
            self.refused.inc()
        return wait_s


async def redis_down(request: Request, exc: Exception) -> JSONResponse:
    """A write that found Redis away: nothing was changed; the client may try again."""
    return JSONResponse(
        {"detail": f"redis unavailable: {brief(exc)}"},
        status_code=503,
        headers={"Retry-After": "2"},
    )


def build_app(settings: CoordinatorSettings) -> FastAPI:
    tasks = BackgroundTasks()
    # writes, now and then
    r = connect(settings.redis_url, retry_once=True, ca_file=settings.tls_ca_file)
    store = RunStore(r, settings.audit_ttl_s)
    # a refresh knows at once Redis is gone
    reads = connect(settings.redis_url, fail_fast=True, ca_file=settings.tls_ca_file)
    model = ReadModel(reads, settings.read_refresh_s)
    data_plane = DataPlaneProcess(settings)
    auth = auth_for(settings)
    # this process's own metrics; the data plane's are relayed after them
    registry = CollectorRegistry()
    refused = Counter(
        "spotrl_api_reads_refused_total",
        "Reads answered 429: the client was over its read rate",
        registry=registry,
    )

    async def exposition() -> bytes:
        return generate_latest(registry) + await data_plane.metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await data_plane.start()
        tasks.start("data plane", data_plane.watch)
        tasks.start("read model", model.forever)
        yield
        await tasks.stop()
        await data_plane.stop()
        await r.aclose()
        await reads.aclose()

    app = FastAPI(
        title="spotrl coordinator",
        version="1",
        lifespan=lifespan,
        description="Runs (submit, follow, cancel), rollout workers, and the dashboard at `/`. "
        "Every write needs `Authorization: Bearer <token>` of its scope when a token is set "
        "(SPOTRL_API_TOKEN: admin, every route). "
        "Reads are limited per client (429 with Retry-After past the limit) and carry an ETag.",
    )
    add_health_and_metrics(
        app,
        "coordinator",
        tasks,
        extra=lambda: {"data_plane": data_plane.status(), "read_model_fresh": model.fresh},
        auth=auth,
        exposition=exposition,
    )
    guard_input(app, tokens_of(settings), settings.max_body_bytes)
    app.add_middleware(ReadLimit, buckets=CountedBuckets(settings, refused))  # outermost

    for error in (RedisConnectionError, RedisTimeoutError, OutOfMemoryError):
        app.add_exception_handler(error, redis_down)
    app.include_router(runs_router(store, model, auth, settings))
    app.include_router(workers_router(r, model, auth, settings.worker_redis_users))
    app.include_router(fleet_router(model, auth))
    add_dashboard(app)
    return app

"""Coordinator: the REST API for runs and workers, and the scheduler (`scheduler`) that makes
the oldest queued run active and drives its rollout manager.
"""

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.coordinator import dashboard, routes_runs, routes_workers
from services.coordinator.observer import Observer
from services.coordinator.runs import RunStore
from services.coordinator.scheduler import schedule_runs
from services.coordinator.settings import CoordinatorSettings
from services.infra.http_limits import guard_input
from services.infra.redis_streams import connect
from services.infra.retry import brief
from services.infra.service import BackgroundTasks, add_health_and_metrics, auth_for

log = logging.getLogger(__name__)


def build_app(settings: CoordinatorSettings) -> FastAPI:
    tasks = BackgroundTasks()
    r = connect(settings.redis_url)
    store = RunStore(r, settings.audit_ttl_s)
    auth = auth_for(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks.start("scheduler", lambda: schedule_runs(store, settings))
        observer = Observer(
            r, settings.observe_s, settings.redis_memory_limit_mb, settings.forget_workers_after_s
        )
        tasks.start("observer", observer.forever)
        yield
        await tasks.stop()
        await r.aclose()

    app = FastAPI(
        title="spotrl coordinator",
        version="1",
        lifespan=lifespan,
        description="Runs (submit, follow, cancel), rollout workers, and the dashboard at `/`. "
        "Every write needs `Authorization: Bearer <SPOTRL_API_TOKEN>` when a token is set.",
    )
    add_health_and_metrics(app, "coordinator", tasks, auth=auth)
    guard_input(app, settings.api_token, settings.max_body_bytes)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    @app.exception_handler(OutOfMemoryError)
    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        # nothing was changed; the client may try again once Redis is back
        return JSONResponse(
            {"detail": f"redis unavailable: {brief(exc)}"},
            status_code=503,
            headers={"Retry-After": "2"},
        )

    app.include_router(routes_runs.build_router(store, auth, settings))
    app.include_router(routes_workers.build_router(r, auth))
    dashboard.add_dashboard(app)
    return app

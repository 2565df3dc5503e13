"""Coordinator: the REST API for runs and workers, and the scheduler that makes the oldest
queued run active and drives its rollout manager.
"""

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import Gauge
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.contracts import keys
from services.contracts.runspec import FINAL_STATES
from services.coordinator import cleanup, dashboard, routes_runs, routes_workers
from services.coordinator.observer import Observer
from services.coordinator.rollout_manager import RunManager
from services.coordinator.runs import RunFailed, RunStore
from services.coordinator.settings import CoordinatorSettings
from services.infra.http_limits import clip, guard_input
from services.infra.redis_streams import connect, text, with_reconnect
from services.infra.retry import brief
from services.infra.service import BackgroundTasks, add_health_and_metrics, auth_for
from services.state.run_state import RunStopped

log = logging.getLogger(__name__)
QUEUED = Gauge("spotrl_coordinator_runs_queued", "Runs waiting in the queue")
MAX_ERROR_CHARS = 1000


def failure_text(exc: Exception) -> str:
    """A failed run's error as users read it: the exception's type and message, cut short;
    never its repr (the repr of a decoding error holds the bytes it could not decode)."""
    return clip(f"{type(exc).__name__}: {exc}", MAX_ERROR_CHARS)


async def ended_as(store: RunStore, run_id: str) -> str | None:
    """The final state of a run (cancelled under its manager, say), or None while it is live."""
    state = text(await store.r.hget(keys.run(run_id), "state"))
    return state if state in FINAL_STATES else None


async def settle(store: RunStore, run_id: str, state: str) -> None:
    """The manager of a run that ended under it has stopped: drop what it wrote meanwhile."""
    await cleanup.release_run(store.r, run_id, state, store.audit_ttl_s)
    if await store.active() == run_id:
        await store.r.delete(keys.ACTIVE_RUN)


async def schedule_runs(store: RunStore, settings: CoordinatorSettings) -> None:
    """Forever: activate the oldest queued run (or resume the active one) and drive it."""
    while True:
        run_id = await with_reconnect(store.active, "active run") or await with_reconnect(
            store.activate_next, "activate run"
        )
        QUEUED.set(await with_reconnect(lambda: store.r.llen(keys.RUN_QUEUE), "run queue"))
        if run_id is None:
            await asyncio.sleep(settings.scheduler_poll_s)
            continue
        log.info("run %s active", run_id)
        try:
            spec = await store.spec(run_id)
            await RunManager.configured(store.r, run_id, spec, settings).run()
        except RunStopped as exc:
            log.info("run %s stopped: %s", run_id, exc)
            await settle(store, run_id, await ended_as(store, run_id) or "cancelled")
            continue
        except RunFailed as exc:  # it cannot go on: its reason is the error
            log.error("run %s failed: %s", run_id, exc)
            await store.finish(run_id, "failed", str(exc))
            continue
        except (RedisConnectionError, RedisTimeoutError, OutOfMemoryError) as exc:
            # Redis went away (or refused a write at its memory limit) mid-step: everything that
            # landed is in Redis, each batch whole or not at all; resume from it
            log.warning(
                "run %s: redis unavailable (%s); resuming once it is back", run_id, brief(exc)
            )
            await asyncio.sleep(settings.scheduler_poll_s)
            continue
        except Exception as exc:
            ended = await ended_as(store, run_id)
            if ended is not None:  # its keys went while the manager still read them
                log.info("run %s stopped (%s) under its manager: %s", run_id, ended, exc)
                await settle(store, run_id, ended)
                continue
            log.exception("run %s failed", run_id)
            await store.finish(run_id, "failed", failure_text(exc))
            continue
        await store.finish(run_id, "succeeded")
        log.info("run %s succeeded", run_id)


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

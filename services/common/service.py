"""What every spotrl HTTP service shares: /healthz, /metrics, bearer-token auth on writes, and
supervised background tasks that fail loudly.
"""

import asyncio
import hmac
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger(__name__)


class BackgroundTasks:
    """Owns a service's long-running tasks. A task that dies marks the service unhealthy."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task] = {}
        self.failures: dict[str, str] = {}

    def start(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self.tasks[name] = task
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failures[task.get_name()] = repr(exc)
            log.critical("background task %s died; shutting down", task.get_name(), exc_info=exc)
            # A service whose loop died must not look alive: stop it so a supervisor sees it.
            signal.raise_signal(signal.SIGTERM)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Cancel every task and wait for them, re-cancelling any that swallowed it."""
        pending = {t for t in self.tasks.values() if not t.done()}
        deadline = asyncio.get_running_loop().time() + timeout_s
        while pending:
            for task in pending:
                task.cancel()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                log.error("tasks would not stop: %s", [t.get_name() for t in pending])
                return
            _, pending = await asyncio.wait(pending, timeout=min(left, 0.5))

    @property
    def healthy(self) -> bool:
        return not self.failures


def add_health_and_metrics(
    app: FastAPI, service: str, tasks: BackgroundTasks, extra: Callable[[], dict] | None = None
) -> None:
    @app.get("/healthz", tags=["ops"])
    async def healthz() -> JSONResponse:
        body = {"service": service, "ok": tasks.healthy, "failures": tasks.failures}
        if extra is not None:
            body.update(extra())
        return JSONResponse(body, status_code=200 if tasks.healthy else 503)

    @app.get("/metrics", tags=["ops"])
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def token_guard(token: str | None) -> Callable[[Request], None]:
    """A dependency that requires `Authorization: Bearer <token>` when a token is configured."""

    def check(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(
                401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}
            )

    return check


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def serve(app: FastAPI, host: str, port: int, graceful_s: float | None = None) -> None:
    """Run an app under uvicorn until SIGINT/SIGTERM."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=graceful_s,
    )
    uvicorn.Server(config).run()

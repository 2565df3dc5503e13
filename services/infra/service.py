"""What every spotrl HTTP service shares: /healthz, /metrics, bearer-token auth on writes, and
supervised background tasks that fail loudly.

The `token_guard` dependencies declare the bearer scheme in the OpenAPI spec; the same check
runs earlier, before any body byte is read, in `http_limits.InputGuard`.
"""

import asyncio
import gc
import hmac
import json
import logging
import os
import signal
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from services.infra import stack_dump
from services.infra.cancel import cancel_and_wait
from services.infra.redis_streams import REDIS_DOWN
from services.infra.retry import retry

if TYPE_CHECKING:
    from services.infra.settings import CommonSettings

log = logging.getLogger(__name__)
# this process, as /healthz and the port file name it (a port alone may be another process's)
INSTANCE = uuid.uuid4().hex


class BackgroundTasks:
    """Owns a service's long-running tasks. A task that dies marks the service unhealthy."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task] = {}
        self.failures: dict[str, str] = {}

    def start(self, name: str, loop: Callable[[], Coroutine[Any, Any, Any]]) -> asyncio.Task:
        """Run `loop()` as a task; while Redis is unreachable (a restart) or refuses writes at
        its memory limit, start it again after a backoff instead of dying: everything a loop
        must not lose is in Redis."""
        task = asyncio.create_task(self._resilient(name, loop), name=name)
        self.tasks[name] = task
        task.add_done_callback(self._on_done)
        return task

    @staticmethod
    async def _resilient(name: str, loop: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        return await retry(loop, f"{name} (redis unavailable)", REDIS_DOWN, first_delay_s=0.2)

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
        pending = await cancel_and_wait(self.tasks.values(), timeout_s)
        if pending:
            log.error("tasks would not stop: %s", [t.get_name() for t in pending])

    @property
    def healthy(self) -> bool:
        return not self.failures


class ErrorBody(BaseModel):
    """What every error response carries (FastAPI's shape; a list for validation errors)."""

    detail: str | list[dict[str, Any]]


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for the error codes a route can answer."""
    return {code: {"model": ErrorBody, "description": ERROR_TEXT[code]} for code in codes}


ERROR_TEXT = {
    400: "Rejected: the request is well-formed but cannot be carried out.",
    401: "Missing or wrong bearer token.",
    404: "No such resource.",
    409: "Conflicts with the resource's state.",
    413: "Too large.",
    416: "Range not satisfiable.",
    429: "Over this client's read rate: retry after the Retry-After header's seconds.",
    503: "Redis is unavailable: nothing was changed; retry after the Retry-After header's seconds.",
}


@dataclass(frozen=True)
class Auth:
    """The route dependencies of one service: `write` guards every change; `read` is empty
    unless reads are protected too. Each route declares the 401 it can answer."""

    write: list[Any]
    read: list[Any]
    write_errors: dict[int | str, dict[str, Any]]
    read_errors: dict[int | str, dict[str, Any]]


def auth_for(settings: "CommonSettings") -> Auth:
    """Open when no token is set (the embedded default on one machine); else every write, and
    every read when `protect_reads`, needs the token."""
    if settings.api_token is None:
        return Auth([], [], {}, {})
    guard, guarded = [Depends(token_guard(settings.api_token))], errors(401)
    if settings.protect_reads:
        return Auth(guard, guard, guarded, guarded)
    return Auth(guard, [], guarded, {})


def add_health_and_metrics(
    app: FastAPI,
    service: str,
    tasks: BackgroundTasks,
    extra: Callable[[], dict] | None = None,
    auth: Auth | None = None,
    exposition: Callable[[], Awaitable[bytes]] | None = None,
) -> None:
    """/healthz stays open (probes carry no token); /metrics is a read: this process's
    registry, or what `exposition` gives."""

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> JSONResponse:
        body = {
            "service": service,
            "instance": INSTANCE,
            "ok": tasks.healthy,
            "failures": tasks.failures,
        }
        if extra is not None:
            body.update(extra())
        return JSONResponse(body, status_code=200 if tasks.healthy else 503)

    @app.get(
        "/metrics",
        tags=["ops"],
        dependencies=auth.read if auth else [],
        responses=auth.read_errors if auth else {},
        response_class=PlainTextResponse,
    )
    async def metrics() -> Response:
        body = await exposition() if exposition is not None else generate_latest()
        return Response(body, media_type=CONTENT_TYPE_LATEST)


BEARER = HTTPBearer(auto_error=False, description="The deployment's API token (SPOTRL_API_TOKEN).")


def token_guard(token: str) -> Callable[..., None]:
    """A dependency that requires `Authorization: Bearer <token>`. It is declared as the bearer
    security scheme, so the OpenAPI spec says which routes need it."""

    def check(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)],
    ) -> None:
        given = credentials.credentials if credentials else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(
                401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}
            )

    return check


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def pin_cpus(spec: str | None) -> None:
    """Run this process on the cores `spec` names ('0-3,8'); nothing where it is None or the
    platform has no affinity call."""
    if spec is None or not hasattr(os, "sched_setaffinity"):
        return
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    os.sched_setaffinity(0, cores)


def serve(
    app: FastAPI,
    host: str,
    port: int,
    graceful_s: float | None = None,
    port_file: Path | None = None,
) -> None:
    """Run an app under uvicorn until SIGINT/SIGTERM.

    The socket is bound first (port 0: any free one; a port taken: the process exits 3), then
    `port_file` gets the port bound and this process's instance id, which /healthz also
    answers: a healthcheck reading it probes this process, never another one that holds the port
    it was told (`services.infra.healthcheck`).

    What was imported is moved out of the garbage collector's sight first (`gc.freeze`): a
    service's heap is mostly modules, and a full collection walking them paused the coordinator
    for up to 160 ms and took a quarter of its CPU under load.

    SIGUSR1 writes every thread's and task's stack to the log (`stack_dump`)."""
    if port_file is not None:
        port_file.unlink(missing_ok=True)  # a file from an earlier start names another process
    gc.collect()
    gc.freeze()
    stack_dump.install()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
        # uvicorn annotates int, but only hands it to asyncio.wait_for, which takes float seconds
        timeout_graceful_shutdown=graceful_s,  # type: ignore[arg-type]
    )
    sock = config.bind_socket()  # logs the error and exits (3) when the port cannot be bound
    if port_file is not None:
        write_port_file(port_file, sock.getsockname()[1])
    uvicorn.Server(config).run(sockets=[sock])


def write_port_file(path: Path, port: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps({"port": port, "instance": INSTANCE, "pid": os.getpid()}))
    tmp.replace(path)

"""What every spotrl HTTP service shares: /healthz, /metrics, scoped bearer-token auth
(`Auth`, `services.infra.scopes`), and supervised background tasks that fail loudly.

The `ScopeGuard` dependencies declare the bearer scheme in the OpenAPI spec; the same check
runs earlier on writes, before any body byte is read, in `http_limits.InputGuard`.
"""

import asyncio
import gc
import json
import logging
import os
import resource
import signal
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from services.infra import stack_dump, tls
from services.infra.cancel import cancel_and_wait
from services.infra.connection_guard import ConnectionGuard, ServerGuard, guard_metrics
from services.infra.connection_limits import ConnectionLimits
from services.infra.redis_streams import REDIS_DOWN
from services.infra.retry import retry
from services.infra.scopes import Scope, Tokens, allows, refusal_text

if TYPE_CHECKING:
    from services.infra.settings import CommonSettings

log = logging.getLogger(__name__)
OPEN_FILES_WANTED = 65536  # a server's soft limit on open files, where the hard one allows
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
    403: "The token's scope may not do this.",
    404: "No such resource.",
    409: "Conflicts with the resource's state.",
    413: "Too large.",
    416: "Range not satisfiable.",
    429: "Over this client's read rate: retry after the Retry-After header's seconds.",
    503: "Redis is unavailable: nothing was changed; retry after the Retry-After header's seconds.",
}


ADMIN_ONLY: frozenset[Scope] = frozenset({"admin"})  # a write no route declares scopes for


class Need(NamedTuple):
    """What a route declares for its scopes: `dependencies=` and `responses=` (401, 403)."""

    dependencies: list[Any]
    responses: dict[int | str, dict[str, Any]]


class Auth:
    """The route dependencies of one service, by the scopes a route needs: `need("admin")`,
    `need("worker")`, `need("read", "worker", "trainer")`. With no token set, every route is
    open (the embedded default on one machine). Else a write needs a token of its scope; a
    read, a route the read scope may use, stays open unless `protect_reads`."""

    def __init__(self, tokens: Tokens | None = None, protect_reads: bool = False) -> None:
        self.tokens = tokens if tokens is not None and tokens.on else None
        self.protect_reads = protect_reads

    def need(self, *scopes: Scope) -> Need:
        needed = frozenset(scopes) or ADMIN_ONLY
        if self.tokens is None or ("read" in needed and not self.protect_reads):
            return Need([], {})  # a fresh list: FastAPI keeps what it is given
        return Need([Depends(ScopeGuard(self.tokens, needed))], errors(401, 403))


def tokens_of(settings: "CommonSettings") -> Tokens:
    """The tokens a service accepts: its api_token as admin, and its accept_tokens."""
    return Tokens.of(settings.api_token, settings.accept_tokens)


def auth_for(settings: "CommonSettings") -> Auth:
    return Auth(tokens_of(settings), settings.protect_reads)


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
    read = (auth or Auth()).need("read")

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
        dependencies=read.dependencies,
        responses=read.responses,
        response_class=PlainTextResponse,
    )
    async def metrics() -> Response:
        body = await exposition() if exposition is not None else generate_latest()
        body += tls.expiry_metrics() + guard_metrics()
        return Response(body, media_type=CONTENT_TYPE_LATEST)


BEARER = HTTPBearer(
    auto_error=False,
    description="An API token: SPOTRL_API_TOKEN (admin), or one of SPOTRL_ACCEPT_TOKENS "
    "with the route's scope.",
)


@dataclass(frozen=True, eq=False)  # hashed by identity: FastAPI caches dependencies by it
class ScopeGuard:
    """A dependency that requires `Authorization: Bearer <token>` with a token of one of the
    `needed` scopes: 401 without a token it accepts, 403 for one of another scope. It is
    declared as the bearer security scheme, so the OpenAPI spec says which routes need it;
    `http_limits.InputGuard` reads `needed` off it to make the same check before the body."""

    tokens: Tokens
    needed: frozenset[Scope]

    def __call__(
        self, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]
    ) -> None:
        granted = self.tokens.scope_of(credentials.credentials if credentials else "")
        if granted is None:
            raise HTTPException(
                401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}
            )
        if not allows(granted, self.needed):
            raise HTTPException(403, refusal_text(granted, self.needed))


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
    app: FastAPI, settings: "CommonSettings", port: int, graceful_s: float | None = None
) -> None:
    """Run an app under uvicorn on the settings' host and `port` until SIGINT/SIGTERM: HTTPS when
    they name a certificate (`services.infra.tls`), else plain HTTP, with one warning line when
    that is off loopback (`server_config`).

    The socket is bound first (port 0: any free one; a port taken: the process exits 3), then
    the settings' `port_file` gets the port bound and this process's instance id, which /healthz
    also answers: a healthcheck reading it probes this process, never another one that holds
    the port it was told (`services.infra.healthcheck`).

    What was imported is moved out of the garbage collector's sight first (`gc.freeze`): a
    service's heap is mostly modules, and a full collection walking them paused the coordinator
    for up to 160 ms and took a quarter of its CPU under load.

    SIGUSR1 writes every thread's and task's stack to the log (`stack_dump`)."""
    port_file = settings.port_file
    if port_file is not None:
        port_file.unlink(missing_ok=True)  # a file from an earlier start names another process
    raise_open_files_limit()
    gc.collect()
    gc.freeze()
    stack_dump.install()
    tls.warn_if_plain(settings, app.title)
    config = server_config(app, settings, port, graceful_s)
    sock = config.bind_socket()  # logs the error and exits (3) when the port cannot be bound
    if port_file is not None:
        write_port_file(port_file, sock.getsockname()[1])
    uvicorn.Server(config).run(sockets=[sock])


def raise_open_files_limit(want: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft limit on open files toward `want`, within its hard limit: a
    server holds a socket per client connection (up to `per_client` of each address), besides
    its Redis, peer and file descriptors, and the usual soft limit of 1,024 ran out under a
    thousand slow clients. One warning line when the hard limit keeps it lower; the limit in
    force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("open files limited to %d (hard limit): a client per file at most", soft)
    return soft


def server_config(
    app: FastAPI, settings: "CommonSettings", port: int, graceful_s: float | None = None
) -> uvicorn.Config:
    """How `serve` has uvicorn serve an app: the settings' host and certificate, and every
    connection through the guard of slow and greedy clients (`guarded_http`)."""
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=port,
        log_level="warning",
        lifespan="on",
        # uvicorn annotates int, but only hands it to asyncio.wait_for, which takes float seconds
        timeout_graceful_shutdown=graceful_s,  # type: ignore[arg-type]
        http=guarded_http(settings.connection_limits(), app.title),
        **tls.uvicorn_args(settings),
    )
    if tls.enabled(settings):
        watch_certificate(app, config, settings)
    return config


def guarded_http(limits: ConnectionLimits, server: str) -> type[asyncio.Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`: uvicorn's own HTTP/1.1 protocol
    (httptools, else h11) behind a `ConnectionGuard`, all its connections sharing one count of
    their clients."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    shared = ServerGuard(limits, server)

    class GuardedHTTP(ConnectionGuard):
        def __init__(
            self, config: uvicorn.Config, server_state: Any, app_state: dict, _loop: Any = None
        ) -> None:
            inner = AutoHTTPProtocol(  # type: ignore[call-arg]
                config=config, server_state=server_state, app_state=app_state, _loop=_loop
            )
            super().__init__(inner, shared)

    return GuardedHTTP


def watch_certificate(app: FastAPI, config: uvicorn.Config, settings: "CommonSettings") -> None:
    """Serve the settings' certificate as its files hold it now, not as they did at start: the
    app's lifespan runs the watcher (`tls_reload`) that re-reads them every
    `tls_reload_interval_s`, for uvicorn's context and the block/peer servers' alike."""
    from services.infra import tls_reload  # cryptography: only where TLS is served

    served = tls_reload.served(settings)
    config.load()  # uvicorn's SSLContext exists from here on
    assert config.ssl is not None, "uvicorn was given no certificate"
    served.attach(config.ssl)
    tasks = BackgroundTasks()

    def start() -> asyncio.Task:
        return tasks.start("tls reload", lambda: served.watch(settings.tls_reload_interval_s))

    app.router.lifespan_context = tls_reload.watching(app.router.lifespan_context, start)


def write_port_file(path: Path, port: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps({"port": port, "instance": INSTANCE, "pid": os.getpid()}))
    tmp.replace(path)

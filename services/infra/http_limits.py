"""What every spotrl HTTP service does with untrusted input before a handler sees it.

- A write (POST/PUT/PATCH/DELETE) needs a bearer token of the route's scope (the scopes its
  `ScopeGuard` dependency declares; admin for a write no route declares), checked before one
  byte of its body is read: a stranger's upload, or a worker token's commit, costs the headers
  only (401 without an accepted token, 403 for another scope).
- Each route has a body size limit: a declared Content-Length over it is a 413 at once; a body
  sent without one (chunked) is counted as it streams and cut off with a 413 past the limit.
- Error bodies are bounded: a 422 lists at most a few errors, each without the input it was
  given, and no 4xx echoes more than a few hundred characters of what the client sent.

It does not decide which routes exist or what a valid body is: the routes and their pydantic
models do. The `ScopeGuard` dependencies stay on the routes so the OpenAPI spec declares the
bearer scheme; the middleware only makes the same check earlier.
"""

import hmac
import json
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, compile_path

from services.infra.scopes import Scope as TokenScope
from services.infra.scopes import Tokens, allows, bearer_of, refusal_text
from services.infra.service import ADMIN_ONLY, ScopeGuard

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MAX_ERRORS = 20  # validation errors listed in one 422
MAX_ERROR_BODY_BYTES = 4096
MAX_TEXT_CHARS = 200  # of one message, one location part or one context value
MAX_DETAIL_CHARS = 1000  # of a plain-text `detail`
MAX_LOC_PARTS = 8

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def clip(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """`text`, cut to `limit` characters with a marker saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def _scalar(value: Any) -> Any:
    """A context value safe to show: short strings and finite numbers only."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if abs(value) < 10**18 else clip(str(value), 40)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return clip(value, 40)
    return None


def bound_errors(raw: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """FastAPI's validation errors (loc, msg, type), without the input that failed, with short
    texts, at most MAX_ERRORS of them and at most MAX_ERROR_BODY_BYTES as JSON."""
    out: list[dict[str, Any]] = []
    for err in raw[:MAX_ERRORS]:
        loc = [
            part if isinstance(part, int) else clip(str(part), 64)
            for part in list(err.get("loc", ()))[:MAX_LOC_PARTS]
        ]
        item: dict[str, Any] = {
            "loc": loc,
            "msg": clip(str(err.get("msg", ""))),
            "type": clip(str(err.get("type", "")), 64),
        }
        shown = {clip(str(k), 40): _scalar(v) for k, v in (err.get("ctx") or {}).items()}
        ctx = {k: v for k, v in shown.items() if v is not None}
        if ctx:
            item["ctx"] = ctx
        out.append(item)
    left_out = len(raw) - len(out)
    while out and len(json.dumps(out)) > MAX_ERROR_BODY_BYTES - 200:
        out.pop()
        left_out += 1
    if left_out:
        out.append({"loc": [], "msg": f"{left_out} more errors not shown", "type": "too_many"})
    return out


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": bound_errors(list(exc.errors()))}, status_code=422)


async def bounded_http_error(request: Request, exc: Exception) -> Response:
    """An HTTPException as FastAPI renders it, with a text `detail` cut to a bounded length."""
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc.detail, str) and len(exc.detail) > MAX_DETAIL_CHARS:
        exc = StarletteHTTPException(
            exc.status_code, clip(exc.detail, MAX_DETAIL_CHARS), exc.headers
        )
    return await http_exception_handler(request, exc)


def authorized(headers: Mapping[str, str], token: str) -> bool:
    """Whether `Authorization: Bearer <token>` was given (compared in constant time)."""
    given = bearer_of(headers.get("authorization", ""))
    return hmac.compare_digest(given.encode(), token.encode())


def declared_length(headers: Mapping[str, str]) -> int | None:
    """The Content-Length the client declared; None without one; -1 when it is not a number."""
    raw = headers.get("content-length")
    if raw is None:
        return None
    return int(raw) if raw.strip().isdigit() and len(raw) < 20 else -1


@dataclass(frozen=True)
class BodyLimits:
    """Body size limit by route: the first template of `routes` whose path matches, else the
    default. Templates are FastAPI paths (`/v1/models/{model}/files/{name}`)."""

    default_bytes: int
    routes: tuple[tuple[re.Pattern[str], int], ...] = ()

    @classmethod
    def of(cls, default_bytes: int, routes: Mapping[str, int] | None = None) -> "BodyLimits":
        compiled = tuple((compile_path(path)[0], n) for path, n in (routes or {}).items())
        return cls(default_bytes, compiled)

    def for_path(self, path: str) -> int:
        for pattern, limit in self.routes:
            if pattern.match(path):
                return limit
        return self.default_bytes


class BodyTooLarge(Exception):
    """A streamed body went past its route's limit."""


def _json_reply(status: int, detail: str, headers: dict[str, str] | None = None) -> list[Message]:
    body = json.dumps({"detail": detail}).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        # the rest of the body is not wanted: end the connection instead of reading it
        (b"connection", b"close"),
        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
    ]
    return [
        {"type": "http.response.start", "status": status, "headers": raw},
        {"type": "http.response.body", "body": body, "more_body": False},
    ]


class RouteScopes:
    """The scopes each write route of an app needs, read off its routes' `ScopeGuard`
    dependencies the first time it is asked (every route is declared by then). A write that no
    route with a guard matches (a 404, a 405) needs admin."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._table: list[tuple[APIRoute, frozenset[TokenScope]]] | None = None

    def table(self) -> list[tuple[APIRoute, frozenset[TokenScope]]]:
        if self._table is None:
            self._table = [
                (route, guard.needed)
                for route in self.app.routes
                if isinstance(route, APIRoute)
                for guard in (d.dependency for d in route.dependencies)
                if isinstance(guard, ScopeGuard)
            ]
        return self._table

    def needed(self, scope: Scope) -> frozenset[TokenScope]:
        for route, needed in self.table():
            if route.matches(scope)[0] == Match.FULL:
                return needed
        return ADMIN_ONLY


class InputGuard:
    """Pure ASGI middleware: a token of the route's scope on writes, then the body limit, before
    the app reads."""

    def __init__(
        self, app: Any, tokens: Tokens | None, limits: BodyLimits, routes: RouteScopes | None
    ) -> None:
        self.app, self.limits, self.routes = app, limits, routes
        self.tokens = tokens if tokens is not None and tokens.on else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.tokens is not None and scope["method"] in WRITE_METHODS:
            refused = self._refusal(scope, headers.get("authorization", ""), self.tokens)
            if refused is not None:
                await self._reply(send, *refused)
                return
        limit = self.limits.for_path(scope["path"])
        declared = declared_length(headers)
        if declared == -1:
            await self._reply(send, 400, "Content-Length is not a number")
            return
        if declared is not None and declared > limit:
            await self._reply(send, 413, too_large_text(limit))
            return
        await self._limited(scope, receive, send, limit)

    def _refusal(
        self, scope: Scope, authorization: str, tokens: Tokens
    ) -> tuple[int, str, dict[str, str] | None] | None:
        """The 401 or 403 this write gets, None when its token may make it."""
        granted = tokens.scope_of(bearer_of(authorization))
        if granted is None:
            return 401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}
        needed = self.routes.needed(scope) if self.routes is not None else ADMIN_ONLY
        if not allows(granted, needed):
            return 403, refusal_text(granted, needed), None
        return None

    async def _limited(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        received, cut_off, started, answered = 0, False, False, False

        async def counted() -> Message:
            nonlocal received, cut_off
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    cut_off = True
                    raise BodyTooLarge
            return message

        async def guarded(message: Message) -> None:
            # once the body was cut off, whatever the app makes of it becomes the 413
            nonlocal started, answered
            if cut_off and not started:
                if not answered:
                    answered = True
                    await self._reply(send, 413, too_large_text(limit))
                return
            started = True
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except BodyTooLarge:
            if not started and not answered:
                await self._reply(send, 413, too_large_text(limit))

    @staticmethod
    async def _reply(
        send: Send, status: int, detail: str, headers: dict[str, str] | None = None
    ) -> None:
        for message in _json_reply(status, detail, headers):
            await send(message)


def too_large_text(limit: int) -> str:
    return f"request body over this route's limit of {limit} bytes"


def guard_input(
    app: FastAPI, tokens: Tokens | None, default_bytes: int, routes: Mapping[str, int] | None = None
) -> None:
    """Install the write guard (the scopes of `app`'s routes), the body limits (`routes`: body
    limit by path template) and the bounded error bodies on `app`."""
    app.add_middleware(
        InputGuard,
        tokens=tokens,
        limits=BodyLimits.of(default_bytes, routes),
        routes=RouteScopes(app),
    )
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, bounded_http_error)

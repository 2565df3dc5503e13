"""Reads that cannot crowd out a service: a per-client rate limit on GET and HEAD (429 with
Retry-After and a short body, before the app does any work), and answers that a poller can
revalidate for free (an ETag; `If-None-Match` with it answers 304 without a body).

A client is its address (each dashboard, scraper or CLI loop its own); the budgets themselves
are `services.infra.rate_limit`. Writes are not limited here: they keep their own checks (the
token, the body limits).
"""

import hashlib
import json
import time
from collections.abc import Callable

from fastapi import Request, Response

from services.infra.http_limits import Receive, Scope, Send
from services.infra.rate_limit import ClientBuckets, retry_after_s

READ_METHODS = frozenset({"GET", "HEAD"})
# OpenAPI `responses` of a read that carries an ETag (with `errors(429, ...)`)
NOT_MODIFIED: dict[int | str, dict] = {
    304: {"description": "Not modified: the If-None-Match ETag is the answer's current one."}
}
JSON = "application/json"


class ReadLimit:
    """Pure ASGI middleware: a GET or HEAD over its client's budget is a 429 at once."""

    def __init__(
        self, app: object, buckets: ClientBuckets, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.app, self.buckets, self.clock = app, buckets, clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in READ_METHODS:
            client = scope.get("client")
            wait_s = self.buckets.take(client[0] if client else "", self.clock())
            if wait_s > 0:
                await self._too_many(send, retry_after_s(wait_s))
                return
        await self.app(scope, receive, send)  # type: ignore[operator]

    async def _too_many(self, send: Send, after_s: int) -> None:
        rate = self.buckets.rate_per_s
        detail = f"over this client's read rate of {rate:g}/s; retry after {after_s} s"
        body = json.dumps({"detail": detail}).encode()
        headers = [
            (b"content-type", JSON.encode()),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(after_s).encode()),
        ]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def etag_of(body: bytes) -> str:
    """A strong ETag for a body: a short hash of its bytes, quoted."""
    return '"' + hashlib.blake2b(body, digest_size=12).hexdigest() + '"'


def revalidated(request: Request, body: bytes, etag: str, media_type: str = JSON) -> Response:
    """`body` with its ETag, or 304 when the client already holds it (`If-None-Match`).
    `no-cache`: a client may keep it, but asks again each time (and gets a 304 while unchanged)."""
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    given = request.headers.get("if-none-match", "")
    if given and (given.strip() == "*" or etag in (tag.strip() for tag in given.split(","))):
        return Response(status_code=304, headers=headers)
    return Response(body, media_type=media_type, headers=headers)

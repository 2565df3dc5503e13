"""Serving the files of weight versions with zero copy: the weight store serves its committed
versions, a rollout worker the versions it pulled (and, while it pulls, the blocks it verified)
to its peers. The path and the range protocol are the store API's
(`GET /v1/models/{model}/versions/{version}/files/{name}` with `Range: bytes=a-b`), so a puller
fetches a block from any source the same way and checks it against the store's manifest.

aiohttp's FileResponse answers a range with `loop.sendfile` (os.sendfile: the kernel moves the
page cache to the socket, no byte passes through Python). uvicorn has no such path, and uvloop
(the services' loop) has no sendfile, so this server runs apart: in a thread, on a plain asyncio
loop of its own. It decides nothing about what may be served: `resolve` says which file, if any,
answers a request.

Given an SSLContext (the service's certificate, `services.infra.tls.server_context`) it serves
HTTPS. The kernel cannot encrypt, so there is no sendfile under TLS: asyncio's `loop.sendfile`
finds the TLS transport unable to and falls back to reading the file into buffers and writing
them through the TLS layer (every byte passes through Python and OpenSSL).
"""

import asyncio
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from prometheus_client import Counter

from services.infra.connection_guard import guarded
from services.infra.connection_limits import ConnectionLimits
from services.infra.scopes import Scope, Tokens, allows, bearer_of, refusal_text
from services.weights.contract import MAX_VERSION

log = logging.getLogger(__name__)
FILES = "/v1/models/{model}/versions/{version}/files/{name}"
PACE_BYTES = 1024 * 1024  # under an egress limit, sendfile moves this much at a time
SERVED = Counter("spotrl_blocks_served_bytes_total", "Weight bytes served", ["server"])
REFUSED = Counter("spotrl_blocks_busy_total", "Block requests refused as busy (503)", ["server"])

# model, version, file name, first byte, last byte (None: to the end) -> the file that holds
# those bytes, or None when this server does not serve them
Resolve = Callable[[str, int, str, int, int | None], Path | None]


class EgressLimit:
    """A token bucket of bytes per second over every response of one server (its loop's thread
    only), with `burst_s` of burst: a link's rate from the first byte, as a capped link (the
    emulated cross-region one of bench/weight_pull.py) has, not a second's worth free."""

    def __init__(self, bytes_per_s: float, burst_s: float = 0.05) -> None:
        self.rate, self.burst = bytes_per_s, bytes_per_s * burst_s
        self.tokens = self.burst
        self.at = time.monotonic()

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate) - n
        self.at = now
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


class BlockFile(web.FileResponse):
    """A FileResponse that its server counts while it sends (the bytes, the responses under
    way), in steps of PACE_BYTES under an egress limit."""

    def __init__(self, path: Path, server: "BlockServer", limit: EgressLimit | None) -> None:
        super().__init__(path)
        self.server, self.limit = server, limit

    async def _sendfile(self, request, fobj, offset: int, count: int):  # type: ignore[override]
        self.server.serving += 1
        try:
            if self.limit is None:
                writer = await super()._sendfile(request, fobj, offset, count)
            else:
                writer = await self._paced(request, fobj, offset, count, self.limit)
        finally:
            self.server.serving -= 1
        self.server.served.inc(count)
        return writer

    async def _paced(self, request, fobj, offset: int, count: int, limit: EgressLimit):
        writer = await web.StreamResponse.prepare(self, request)
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("connection lost")
        loop = asyncio.get_running_loop()
        while count > 0:
            n = min(PACE_BYTES, count)
            await limit.take(n)
            await loop.sendfile(transport, fobj, offset, n)
            offset, count = offset + n, count - n
        await web.StreamResponse.write_eof(self)
        return writer


class BlockServer:
    """An HTTP server of version files on its own thread. At most `max_serving` responses at
    once: past that a request is answered 503 (busy), so that a puller takes the block from
    another source. Its connections go through the guard of slow and greedy clients
    (`services.infra.connection_guard`) with `limits`."""

    def __init__(
        self,
        resolve: Resolve,
        host: str,
        port: int = 0,
        token: Tokens | str | None = None,
        max_serving: int = 16,
        egress_bytes_per_s: float | None = None,
        name: str = "store",
        ssl_context: ssl.SSLContext | None = None,
        scopes: frozenset[Scope] = frozenset({"read"}),
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.resolve, self.host, self.port = resolve, host, port
        self.ssl_context = ssl_context  # None: plain HTTP
        # the tokens it accepts (a plain string: the admin token), the scopes that may read
        self.tokens = Tokens.of(token, None) if isinstance(token, str) else token
        self.scopes, self.max_serving, self.name = scopes, max_serving, name
        self.egress = egress_bytes_per_s
        self.limits = limits or ConnectionLimits()
        self.serving = 0
        self.served, self._refused = SERVED.labels(name), REFUSED.labels(name)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Bind (port 0: any free one), serve on a thread, return the port bound."""
        sock = socket.create_server((self.host, self.port), reuse_port=False)
        self.port = sock.getsockname()[1]
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(sock, ready), name=f"blocks-{self.name}", daemon=True
        )
        self._thread.start()
        ready.wait()
        scheme = "https" if self.ssl_context is not None else "http"
        log.info("serving weight blocks on %s://%s:%d", scheme, self.host, self.port)
        return self.port

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self, sock: socket.socket, ready: threading.Event) -> None:
        loop = asyncio.SelectorEventLoop()  # has sendfile; uvloop has not
        asyncio.set_event_loop(loop)
        self._loop, self._stop = loop, asyncio.Event()
        limit = EgressLimit(self.egress) if self.egress else None
        app = web.Application()

        async def serve(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, limit)

        app.router.add_get(FILES, serve)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        loop.run_until_complete(runner.setup())
        assert runner.server is not None
        factory = guarded(runner.server, self.limits, self.name)
        listening = loop.run_until_complete(
            loop.create_server(factory, sock=sock, ssl=self.ssl_context)
        )
        ready.set()
        try:
            loop.run_until_complete(self._stop.wait())
        finally:
            listening.close()
            loop.run_until_complete(runner.cleanup())
            # what cleanup cannot reach: a handler still lingering over the body of a client
            # that is gone (aiohttp reads such a body out for up to 10 s)
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.close()

    def _refusal(self, request: web.Request) -> web.Response | None:
        """The 401 or 403 a request gets (its token, its scope), None when it may read."""
        if self.tokens is None or not self.tokens.on:
            return None
        granted = self.tokens.scope_of(bearer_of(request.headers.get("Authorization", "")))
        if granted is None:
            return web.json_response({"detail": "a valid bearer token is required"}, status=401)
        if not allows(granted, self.scopes):
            return web.json_response({"detail": refusal_text(granted, self.scopes)}, status=403)
        return None

    async def _serve(self, request: web.Request, limit: EgressLimit | None) -> web.StreamResponse:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        info = request.match_info
        try:
            version = int(info["version"])
            rng = request.http_range
        except ValueError:
            return web.json_response({"detail": "bad version or range"}, status=400)
        if not 0 <= version <= MAX_VERSION or rng.step not in (None, 1):
            return web.json_response({"detail": "bad version or range"}, status=400)
        start = rng.start or 0
        last = None if rng.stop is None else rng.stop - 1
        if start < 0 or (last is not None and last < start):
            return web.json_response({"detail": "only a range a-b or a- is served"}, status=416)
        path = self.resolve(info["model"], version, info["name"], start, last)
        if path is None:
            return web.json_response({"detail": "not held here"}, status=404)
        if self.serving >= self.max_serving:
            self._refused.inc()
            return web.json_response({"detail": "busy"}, status=503, headers={"Retry-After": "1"})
        return BlockFile(path, self, limit)

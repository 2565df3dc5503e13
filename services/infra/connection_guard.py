"""Slow and greedy clients, stopped at the connection: every spotrl HTTP server (the services'
apps under uvicorn, the aiohttp block and peer servers) takes its connections through a
`ConnectionGuard`, which applies `services.infra.connection_limits`: a connection over its
client's cap is refused at once, one whose request headers or body come slower than they may
is closed. Each is counted in `spotrl_http_connections_closed_total{server, reason}`.

The guard sits between the event loop's transport and the server's own protocol, and follows
each request with a parser of its own (httptools: where a request begins, where its headers end,
where its body ends) to know what the connection waits for. It never changes or answers a
request: a connection past its time is aborted without a response (a client that slow is not
waiting for one), which the server sees as a client gone.

It does not time a response or a client that reads one slowly, the idle time between requests
(the servers' keep-alive timeouts: uvicorn's 5 s, aiohttp's 75 s), nor a TLS handshake
(asyncio's `ssl_handshake_timeout`, 60 s); a connection the parser cannot follow (not HTTP/1.1,
an upgrade) is left to its server from there.
"""

import asyncio
import logging
from collections import Counter as Tally
from collections.abc import Callable
from typing import Any, cast

import httptools
from prometheus_client import CollectorRegistry, Counter, generate_latest

from services.infra.connection_limits import (
    OVER_CAP,
    ClientCounts,
    ConnectionLimits,
    Phase,
    RequestClock,
)

log = logging.getLogger(__name__)
# its own registry, relayed by every service's /metrics (the coordinator's too, whose own
# exposition is not the default registry)
GUARD_REGISTRY = CollectorRegistry()
CLOSED = Counter(
    "spotrl_http_connections_closed_total",
    "Connections a server closed at once over their client's connection cap "
    "(over_client_cap), or past their time to send headers or a body (header_timeout, "
    "body_timeout)",
    ["server", "reason"],
    registry=GUARD_REGISTRY,
)


def guard_metrics() -> bytes:
    return generate_latest(GUARD_REGISTRY)


class RequestPhases:
    """The client's place in its requests, from the bytes it sent, told to `enter` as it
    changes: HEADERS at a request's first byte, BODY once its headers are in, None once the
    whole request is (and for good once the bytes are not HTTP/1.1 it can follow)."""

    def __init__(self, enter: Callable[[Phase | None], None]) -> None:
        self.enter = enter
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)

    def feed(self, data: bytes) -> None:
        if self.parser is None:
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):  # the server's now
            self.parser = None
            self.enter(None)

    # the parser's callbacks (no on_body: the body's bytes are counted, never copied)
    def on_message_begin(self) -> None:
        self.enter(Phase.HEADERS)

    def on_headers_complete(self) -> None:
        self.enter(Phase.BODY)

    def on_message_complete(self) -> None:
        self.enter(None)


class ServerGuard:
    """What the connections of one server share: its limits, its clients' open connections,
    its name in the metric and the log, and the closes counted by reason."""

    def __init__(self, limits: ConnectionLimits, server: str) -> None:
        self.limits, self.server = limits, server
        self.clients = ClientCounts(limits)
        self.closed: Tally[str] = Tally()

    def count_close(self, reason: str, peer: str, detail: str) -> None:
        CLOSED.labels(self.server, reason).inc()
        self.closed[reason] += 1
        n = self.closed[reason]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood of them logs a few lines
            log.warning("%s: closed %s (%s, %s; %d so far)", self.server, peer, reason, detail, n)


class ConnectionGuard(asyncio.Protocol):
    """One connection, guarded: the server's protocol (`inner`) behind it sees every byte."""

    def __init__(self, inner: asyncio.BaseProtocol, shared: ServerGuard) -> None:
        self.inner = cast(asyncio.Protocol, inner)
        self.shared = shared
        self.clock = RequestClock(shared.limits)
        self.phases = RequestPhases(self._enter)
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.peer, self.host = "", ""
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.host, self.peer = str(peer[0]), f"{peer[0]}:{peer[1]}"
        if not self.shared.clients.admit(self.host):
            self.shared.count_close(OVER_CAP, self.peer, f"{self.shared.limits.per_client} open")
            self.transport.abort()
            return
        self.admitted = True
        self._enter(Phase.HEADERS)  # a new connection owes its first request's headers
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        self.phases.feed(data)
        if self.clock.phase is Phase.BODY:
            self.clock.received += len(data)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.admitted:
            self.admitted = False
            self.shared.clients.release(self.host)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def _enter(self, phase: Phase | None) -> None:
        self._disarm()
        self.clock.enter(phase, self.loop.time())
        if phase is not None:
            self.timer = self.loop.call_at(self.clock.deadline(), self._look)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _look(self) -> None:
        """The client's time may be up: close the connection if it is, else look again when it
        may be (its body came on meanwhile, or the server held it back)."""
        self.timer = None
        transport, phase = self.transport, self.clock.phase
        if transport is None or transport.is_closing() or phase is None:
            return
        now = self.loop.time()
        again = self.clock.due(now, transport.is_reading())
        if again is not None:
            self.timer = self.loop.call_at(again, self._look)
            return
        took = f"{now - self.clock.since:.1f} s, {self.clock.received} body bytes"
        self.shared.count_close(phase.value, self.peer, took)
        transport.abort()


def guarded(make: Callable[[], Any], limits: ConnectionLimits, server: str) -> Callable[[], Any]:
    """A protocol factory for `loop.create_server`: each connection `make()`s the server's own
    protocol behind a guard; the connections of all share one count of their clients."""
    shared = ServerGuard(limits, server)
    return lambda: ConnectionGuard(make(), shared)

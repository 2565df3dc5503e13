"""Slow and greedy clients against real servers on 127.0.0.1 (issue 53): a weight store served as
`serve` serves it (uvicorn behind the connection guard, `server_config`), with its aiohttp
block server, under short limits. A client that sends its headers or its body a byte at a time
is closed within its time; a client address past its connection cap is refused while another
is served, and served again once it closed one; an upload at the speed of a link is not cut,
one slower than the limit's rate but long is not cut either. Each close is in the metric.

The second client address is 127.0.0.2 (Linux routes all of 127.0.0.0/8 to loopback)."""

import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from services.cli.procs import free_port
from services.infra.service import server_config
from services.weightstore.app import build_app
from services.weightstore.settings import WeightStoreSettings

HEADER_S, BODY_S, MIN_RATE = 0.5, 1.0, 1024 * 1024  # the limits under test
CAP = 3
SLACK_S = 3.0  # a loaded machine fires a timer late; never early
API, BLOCKS = "spotrl weight store", "store"
OTHER = "127.0.0.2"
UPLOAD = "/v1/models/m/versions/1/files/{name}"


@dataclass
class Store:
    port: int
    block_port: int
    server: uvicorn.Server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[Store]:
    settings = WeightStoreSettings(
        root=tmp_path_factory.mktemp("weights"),
        http_header_timeout_s=HEADER_S,
        http_body_timeout_s=BODY_S,
        http_body_min_bytes_per_s=MIN_RATE,
        http_connections_per_client=CAP,
        http_uncapped_clients="",  # 127.0.0.1 is capped too here
    )
    port = free_port()
    server = uvicorn.Server(server_config(build_app(settings), settings, port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the store never started"
        threading.Event().wait(0.02)
    block_port = httpx.get(f"http://127.0.0.1:{port}/v1/blocks").json()["port"]
    yield Store(port, block_port, server)
    server.should_exit = True
    thread.join(timeout=30)


def closes(store: Store, server: str, reason: str) -> float:
    """The metric's count of `server`'s closes for `reason`, read from /metrics."""
    text = httpx.get(f"{store.url}/metrics").text
    found = re.search(
        rf'spotrl_http_connections_closed_total\{{reason="{reason}",server="{server}"\}} (\S+)',
        text,
    )
    return float(found.group(1)) if found else 0.0


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    sock.setblocking(False)
    return sock


def closed_now(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closed `sock` (wait up to `wait_s` for a sign of it); a response the
    server sent first is read past."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            return False
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def trickle(sock: socket.socket, head: bytes, then: bytes = b"", pace_s: float = 0.05) -> float:
    """Send `head` at once, then `then` a byte every `pace_s` (then nothing), until the server
    closes the connection: the seconds that took (from the first byte sent)."""
    started = time.monotonic()
    try:
        sock.sendall(head)
        for i in range(len(then)):
            if closed_now(sock, pace_s):
                return time.monotonic() - started
            sock.send(then[i : i + 1])
        while not closed_now(sock, 1.0):
            assert time.monotonic() - started < 60, "never closed"
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        sock.close()
    return time.monotonic() - started


@pytest.mark.parametrize("server", [API, BLOCKS])
def test_headers_sent_a_byte_at_a_time_are_cut_off_at_the_header_timeout(store, server):
    port = store.port if server == API else store.block_port
    before = closes(store, server, "header_timeout")
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: a\r\n" * 1000
    took = trickle(connect(port), b"", request)
    assert HEADER_S * 0.9 <= took <= HEADER_S + SLACK_S
    assert closes(store, server, "header_timeout") == before + 1


@pytest.mark.parametrize("server", [API, BLOCKS])
def test_a_connection_that_never_sends_a_request_is_cut_off_too(store, server):
    port = store.port if server == API else store.block_port
    took = trickle(connect(port), b"")
    assert HEADER_S * 0.9 <= took <= HEADER_S + SLACK_S


def test_a_body_sent_a_byte_at_a_time_is_cut_off_at_the_body_timeout(store):
    before = closes(store, API, "body_timeout")
    head = (
        f"PUT {UPLOAD.format(name='slow.bin')} HTTP/1.1\r\nHost: x\r\n"
        "Content-Length: 100000000\r\n\r\n"
    ).encode()
    took = trickle(connect(store.port), head, b"x" * 10_000)
    # its few bytes buy it microseconds over BODY_S at MIN_RATE
    assert BODY_S * 0.9 <= took <= BODY_S + SLACK_S
    assert closes(store, API, "body_timeout") == before + 1


def test_a_body_the_block_server_never_reads_is_cut_off_at_the_body_timeout(store):
    before = closes(store, BLOCKS, "body_timeout")
    head = (
        b"GET /v1/models/m/versions/1/files/a HTTP/1.1\r\nHost: x\r\nContent-Length: 9999\r\n\r\n"
    )
    took = trickle(connect(store.block_port), head, b"x" * 10_000)
    assert BODY_S * 0.9 <= took <= BODY_S + SLACK_S
    assert closes(store, BLOCKS, "body_timeout") == before + 1


def served(port: int, source: str) -> bool:
    """Whether a GET from `source` on a new connection is answered."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=10) as client:
        try:
            client.get(f"http://127.0.0.1:{port}/healthz")
        except httpx.TransportError:
            return False
    return True


@pytest.mark.parametrize("server", [API, BLOCKS])
def test_an_address_past_its_cap_is_refused_while_another_is_served(store, server):
    port = store.port if server == API else store.block_port
    before = closes(store, server, "over_client_cap")
    held = [connect(port, OTHER) for _ in range(CAP)]
    try:
        refused = connect(port, OTHER)
        assert closed_now(refused, 10.0), "a connection past the cap was kept"
        refused.close()
        assert served(port, "127.0.0.1")  # another address: served as ever
        assert closes(store, server, "over_client_cap") == before + 1
        held.pop().close()
        deadline = time.monotonic() + 10  # the server learns of the close a moment later
        while not served(port, OTHER):
            assert time.monotonic() < deadline, "the address was not served after a close"
    finally:
        for sock in held:
            sock.close()


def chunks(total: int, chunk: int, rate_bytes_per_s: float | None) -> Iterator[bytes]:
    """`total` bytes in `chunk`s, each sent when the rate allows (None: at once)."""
    started, sent = time.monotonic(), 0
    while sent < total:
        if rate_bytes_per_s is not None:
            time.sleep(max(0.0, started + sent / rate_bytes_per_s - time.monotonic()))
        n = min(chunk, total - sent)
        sent += n
        yield b"w" * n


@pytest.mark.parametrize(
    ("name", "total", "rate"),
    [
        ("fast.bin", 128 * 1024 * 1024, None),  # a shard at the speed of the link
        # past BODY_S, and at twice the least rate: it keeps earning its time
        ("paced.bin", 4 * MIN_RATE, 2.0 * MIN_RATE),
    ],
)
def test_an_upload_at_a_link_speed_or_above_the_least_rate_is_not_cut(store, name, total, rate):
    before = closes(store, API, "body_timeout")
    started = time.monotonic()
    answer = httpx.put(
        f"{store.url}{UPLOAD.format(name=name)}",
        content=chunks(total, 256 * 1024, rate),
        headers={"Content-Length": str(total)},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["size"] == total
    if rate is not None:
        assert time.monotonic() - started > BODY_S  # longer than the fixed part alone
    assert closes(store, API, "body_timeout") == before

"""Scoped API tokens against the real coordinator and weight store (issue 41): each service
holds only the SHA-256 of the four tokens (SPOTRL_ACCEPT_TOKENS) and protects its reads. The
admin token does everything; a worker token registers a worker and nothing more; a trainer
token uploads and commits weights and nothing more; a read token reads. A wrong scope is a
short 403, decided at the headers: the body of a refused write is never read. A worker's peer
block server takes worker and read tokens only.

The single-token setup (SPOTRL_API_TOKEN alone, as admin) is what test_bad_input,
test_api_fuzz and test_weightstore_api run.
"""

import hashlib
import http.client
import socket
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from services.cli import procs
from services.infra.scopes import Tokens, accept_list
from services.weights.block_server import BlockServer

from .conftest import small_spec

TOKENS = {
    "admin": "admin-tok-3f9a",
    "worker": "worker-tok-81c2",
    "trainer": "trainer-tok-55d0",
    "read": "read-tok-0b7e",
}
MAX_DENIAL_BYTES = 200  # a 401 or 403 body
HUGE = 300 * 1024 * 1024  # over every route's body limit: a 413 if the body were considered
SECURE_ENV = {
    "SPOTRL_ACCEPT_TOKENS": accept_list(TOKENS),
    "SPOTRL_PROTECT_READS": "true",
    "SPOTRL_READ_RATE_PER_S": "100000",
    "SPOTRL_READ_BURST": "100000",
}


def bearer(scope: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[scope]}"}


def started(name: str, module: str, env: dict[str, str], log_dir: Path) -> procs.Proc:
    port = procs.free_port()
    proc = procs.start_service(name, module, env | {"SPOTRL_PORT": str(port)}, log_dir, port)
    try:
        procs.wait_healthy([proc], 120)
    except BaseException:
        proc.stop()
        raise
    return proc


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """A Redis, a weight store and a coordinator, each accepting the four tokens by digest
    (no SPOTRL_API_TOKEN anywhere): their URLs."""
    root = tmp_path_factory.mktemp("scopes")
    logs = root / "logs"
    redis_proc, redis_url = procs.start_redis(logs, root / "redis")
    running = [redis_proc]
    try:
        store = started(
            "weightstore",
            "services.weightstore.main",
            SECURE_ENV | {"SPOTRL_ROOT": str(root / "weights")},
            logs,
        )
        running.append(store)
        coordinator = started(
            "coordinator",
            "services.coordinator.main",
            SECURE_ENV | {"SPOTRL_REDIS_URL": redis_url, "SPOTRL_WEIGHTSTORE_URL": store.url},
            logs,
        )
        running.append(coordinator)
        yield {"coordinator": coordinator.url, "weightstore": store.url}
    finally:
        for proc in reversed(running):
            proc.stop()


def refused(resp: httpx.Response, status: int, scope: str | None = None) -> None:
    """`resp` is a short `status`; a 403 names the token's scope."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert len(resp.content) <= MAX_DENIAL_BYTES, resp.text
    if scope is not None:
        assert resp.json()["detail"].startswith(f"this token's scope ({scope}) may not do this")


def upload(url: str, model: str, version: int, data: bytes, headers: dict) -> httpx.Response:
    return httpx.put(
        f"{url}/v1/models/{model}/versions/{version}/files/w.bin",
        content=data,
        headers=headers | {"x-sha256": hashlib.sha256(data).hexdigest()},
    )


def commit(url: str, model: str, version: int, files: list, headers: dict) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/models/{model}/versions/{version}/commit",
        json={"files": files},
        headers=headers,
    )


WORKER = {"id": "w-scoped-1", "pool": "preemptible", "engine": "hf", "slots": 4}


def writes(co: str, ws: str, run_id: str) -> list[tuple[str, str, dict]]:
    """Every write route: (method, url, json body), on a run and a worker that exist."""
    return [
        ("POST", f"{co}/v1/runs", {"model": "/nowhere"}),
        ("POST", f"{co}/v1/runs/{run_id}/cancel", {}),
        ("POST", f"{co}/v1/workers", WORKER),
        ("POST", f"{co}/v1/workers/{WORKER['id']}/release", {"count": 1}),
        ("DELETE", f"{co}/v1/workers/{WORKER['id']}", {}),
        ("PUT", f"{ws}/v1/models/m/versions/9/files/w.bin", {}),
        ("POST", f"{ws}/v1/models/m/versions/9/commit", {"files": []}),
    ]


def send(method: str, url: str, body: dict, headers: dict) -> httpx.Response:
    return httpx.request(method, url, json=body or None, headers=headers, timeout=30)


def test_each_scope_does_what_it_may_and_nothing_more(services, tiny_model):
    co, ws = services["coordinator"], services["weightstore"]

    # worker: registers itself; every other write is a 403 naming its scope
    resp = httpx.post(f"{co}/v1/workers", json=WORKER, headers=bearer("worker"))
    assert resp.status_code == 201, resp.text

    # admin: submits and cancels
    spec = small_spec(tiny_model, steps=1)
    resp = httpx.post(f"{co}/v1/runs", json=spec, headers=bearer("admin"), timeout=60)
    assert resp.status_code == 201, resp.text
    run_id = resp.json()["id"]

    # trainer: uploads and commits a version
    data = b"weights" * 100
    entry = upload(ws, "m", 1, data, bearer("trainer"))
    assert entry.status_code == 200, entry.text
    resp = commit(ws, "m", 1, [entry.json()], bearer("trainer"))
    assert resp.status_code == 201, resp.text

    for scope, allowed in {
        "worker": {f"{co}/v1/workers"},
        "trainer": {
            f"{ws}/v1/models/m/versions/9/files/w.bin",
            f"{ws}/v1/models/m/versions/9/commit",
        },
        "read": set(),
    }.items():
        for method, url, body in writes(co, ws, run_id):
            if url not in allowed:
                refused(send(method, url, body, bearer(scope)), 403, scope)

    # the store's reads take read, worker and trainer tokens; the coordinator's, read
    for scope in ("read", "worker", "trainer", "admin"):
        for path in ("/v1/models", "/v1/models/m/latest", "/v1/models/m/versions/1/files/w.bin"):
            resp = httpx.get(f"{ws}{path}", headers=bearer(scope))
            assert resp.status_code == 200, (scope, path, resp.text)
        port = httpx.get(f"{ws}/v1/blocks", headers=bearer(scope)).json()["port"]
        blocks = f"http://127.0.0.1:{port}/v1/models/m/versions/1/files/w.bin"
        assert httpx.get(blocks, headers=bearer(scope)).content == data
    refused(httpx.get(blocks), 401)
    for path in ("/v1/runs", f"/v1/runs/{run_id}", "/v1/workers", "/metrics"):
        assert httpx.get(f"{co}{path}", headers=bearer("read")).status_code == 200, path
        refused(httpx.get(f"{co}{path}", headers=bearer("worker")), 403, "worker")
        refused(httpx.get(f"{co}{path}"), 401)
        refused(httpx.get(f"{co}{path}", headers={"Authorization": "Bearer nope"}), 401)

    # a wrong or missing token: 401 on every write
    for method, url, body in writes(co, ws, run_id):
        refused(send(method, url, body, {"Authorization": "Bearer nope"}), 401)
        refused(send(method, url, body, {}), 401)

    # admin passes every check: cancel the run, order and forget the worker (it is not alive)
    resp = httpx.post(f"{co}/v1/runs/{run_id}/cancel", headers=bearer("admin"))
    assert resp.status_code == 200 and resp.json()["state"] == "cancelled", resp.text
    release = f"{co}/v1/workers/{WORKER['id']}/release"
    assert httpx.post(release, json={"count": 1}, headers=bearer("admin")).status_code == 409
    assert (
        httpx.delete(f"{co}/v1/workers/{WORKER['id']}", headers=bearer("admin")).status_code == 204
    )


def raw_write(url: str, method: str, path: str, token: str, length: int) -> tuple[int, bytes]:
    """Send a write's headers, declaring `length` body bytes, and none of the body: the status
    and body of the answer, which must come (and the connection close) with no body sent."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
        )
        reply = b""
        while chunk := sock.recv(65536):  # the refusal closes the connection
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_a_refused_write_is_refused_at_its_headers(services):
    """A huge declared body with the wrong scope is a 403, not a 413: the scope is checked first,
    and the answer comes while the client has sent nothing but headers."""
    co, ws = services["coordinator"], services["weightstore"]
    cases = [
        (co, "POST", "/v1/runs", "worker"),
        (co, "POST", "/v1/workers", "read"),
        (ws, "PUT", "/v1/models/m/versions/5/files/w.bin", "worker"),
        (ws, "POST", "/v1/models/m/versions/5/commit", "worker"),
    ]
    for url, method, path, scope in cases:
        status, body = raw_write(url, method, path, TOKENS[scope], HUGE)
        assert status == 403, (path, body)
        assert len(body) <= MAX_DENIAL_BYTES and f"({scope})".encode() in body
    status, _ = raw_write(co, "POST", "/v1/runs", "nope", HUGE)
    assert status == 401
    status, _ = raw_write(co, "POST", "/v1/runs", TOKENS["admin"], HUGE)
    assert status == 413  # the admin may; the body is too large


def test_a_peer_block_server_serves_workers_and_readers(tmp_path):
    data = bytes(range(256)) * 16
    (tmp_path / "w").write_bytes(data)
    server = BlockServer(
        lambda model, version, name, start, last: tmp_path / name,
        "127.0.0.1",
        token=Tokens.of(None, accept_list(TOKENS)),
        scopes=frozenset({"worker", "read"}),
        name="peer-test",
    )
    server.start()
    try:

        def get(headers: dict) -> tuple[int, bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.request("GET", "/v1/models/m/versions/1/files/w", headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            conn.close()
            return resp.status, body

        for scope in ("worker", "read", "admin"):
            assert get(bearer(scope)) == (200, data), scope
        status, body = get(bearer("trainer"))
        assert status == 403 and b"(trainer)" in body and len(body) <= MAX_DENIAL_BYTES
        assert get({})[0] == get({"Authorization": "Bearer nope"})[0] == 401
    finally:
        server.stop()

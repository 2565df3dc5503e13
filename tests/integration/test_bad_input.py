"""Bad input against every route of every service (coordinator, weight store, trainer, rollout
worker), listed from each one's OpenAPI spec so that a new route is not forgotten: oversized
bodies (declared and streamed), NaN and Infinity, long strings, huge numbers, bad paths and
unauthenticated writes. Each gets a bounded 4xx that does not echo the input, the service stays
healthy, and nothing is left in Redis or on disk. Then: a service bound off loopback without a
token refuses to start, and finished and cancelled runs leave their record, not their scratch.
Real processes, real Redis, real sockets throughout.
"""

import json
import os
import select
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
import redis

from services.cli import procs
from services.cli.client import CoordinatorClient
from services.contracts import keys
from services.contracts.runspec import FINAL_STATES
from services.contracts.runspec.spec import sectioned
from tests.harness.deploy import DeploymentConfig

from .conftest import collected, deploy_config, small_spec, wait_final

TOKEN = "bad-input-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_FILE_BYTES = 8 * 1024 * 1024
HUGE = 300 * 1024 * 1024  # a body no route takes
MAX_ERROR_BYTES = 4096
SECRET = "SECRET-FILE-CONTENT-d41d8cd9"
LONG = "x" * 100_000
URL_LONG = LONG[:60_000]  # httpx sends no URL part over 64 KiB
DIGITS = "9" * 280
WRITES = ("post", "put", "patch", "delete")


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return deploy_config(
        tmp_path_factory.mktemp("bad-input"),
        reserved=0,
        worker_slots=64,
        api_token=TOKEN,
        extra_env={"SPOTRL_MAX_FILE_BYTES": str(MAX_FILE_BYTES), "SPOTRL_OBSERVE_S": "0.5"},
    )


@pytest.fixture(scope="module")
def client(deployment):
    with CoordinatorClient(deployment.coordinator_url, TOKEN) as c:
        yield c


@pytest.fixture(scope="module")
def services(deployment) -> dict[str, str]:
    return {
        "coordinator": deployment.coordinator_url,
        "weightstore": deployment.weightstore_url,
        "trainer": deployment.trainer_url,
        "rollout": deployment.workers()[0].url,
    }


def wait_idle(deployment, services, rdb, timeout_s: float = 60.0) -> None:
    """Until no run is active and the trainer and the worker have let go of the last one (what
    they write on the way out has landed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, "the services never let go of the last run"
        deployment.check_alive()
        if rdb.get(keys.ACTIVE_RUN) is None and all(
            httpx.get(f"{services[name]}/v1/status", timeout=5).json()["run_id"] is None
            for name in ("trainer", "rollout")
        ):
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def finished_run(deployment, services, client, rdb, tiny_model) -> dict:
    """A small run that succeeded: its id, model and files give the routes real parameters."""
    run_id = client.submit(small_spec(tiny_model, steps=1))
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded", run
    wait_idle(deployment, services, rdb)
    return run


def redis_snapshot(r: redis.Redis) -> dict[bytes, bytes]:
    """Every key's serialized value, less the heartbeats (they change every second)."""
    return {k: r.dump(k) for k in sorted(r.scan_iter(count=1000)) if not k.endswith(b":hb")}


def files_under(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def routes(url: str) -> list[tuple[str, str, dict]]:
    """(method, path template, operation) of every route in a service's OpenAPI spec."""
    spec = httpx.get(f"{url}/openapi.json", timeout=10).json()
    return [(m, path, op) for path, ops in spec["paths"].items() for m, op in ops.items()]


def fill(path: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        path = path.replace("{" + name + "}", value)
    assert "{" not in path, f"no value for a parameter of {path}"
    return path


def raw_exchange(
    base: str,
    method: str,
    path: str,
    headers: dict[str, str],
    body_bytes: int,
    chunked: bool = False,
    send_body: bool = True,
) -> tuple[int, bytes, int]:
    """Send a request whose body is `body_bytes` long over a plain socket, feeding the body
    only while no response has come; (status, response body, body bytes sent)."""
    host, port = urlsplit(base).hostname, urlsplit(base).port
    lines = [f"{method.upper()} {path} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {body_bytes}")
    sock = socket.create_connection((host, port), timeout=30)
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    block = b"x" * (256 * 1024)
    piece = f"{len(block):x}\r\n".encode() + block + b"\r\n" if chunked else block
    sent, reply, unsent = 0, b"", b""
    sock.setblocking(False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        writing = [sock] if send_body and sent < body_bytes else []
        readable, writable, _ = select.select([sock], writing, [], 1.0)
        if readable:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            reply += data
            head, _, rest = reply.partition(b"\r\n\r\n")
            length = [
                int(h.split(b":")[1])
                for h in head.split(b"\r\n")
                if h.lower().startswith(b"content-length:")
            ]
            if length and len(rest) >= length[0]:
                break
        elif writable:
            unsent = unsent or piece  # a chunk is sent whole before the next one starts
            try:
                done = sock.send(unsent)
            except (BrokenPipeError, ConnectionResetError):
                send_body = False  # the server hung up: read what it answered
                continue
            sent, unsent = sent + done, unsent[done:]
    sock.close()
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), (method, path, reply[:200])
    return int(head.split()[1]), rest, sent


def assert_refused(service_url, status, body: bytes, what, echoes=(LONG[:64], DIGITS)) -> None:
    """A bounded 4xx that repeats none of the input, and a service that answers at once."""
    assert 400 <= status < 500, (what, status, body[:300])
    assert len(body) <= MAX_ERROR_BYTES, (what, len(body))
    for echo in echoes:
        assert echo.encode() not in body, (what, body[:300])
    assert SECRET.encode() not in body
    healthy(service_url)


def healthy(service_url) -> None:
    """/healthz answers 200 within a second (asked twice at most: a service still busy with
    what it was sent is slow both times, a loaded test machine seldom twice in a row)."""
    for _ in range(2):
        started = time.monotonic()
        resp = httpx.get(f"{service_url}/healthz", timeout=5)
        assert resp.status_code == 200, resp.text
        if time.monotonic() - started < 1.0:
            return
    raise AssertionError(f"{service_url}/healthz took {time.monotonic() - started:.2f}s")


def valid_bodies(tiny_model) -> dict[tuple[str, str], dict]:
    """A body each JSON route takes; the cases below spoil one field at a time."""
    return {
        ("post", "/v1/runs"): sectioned(small_spec(tiny_model)),  # the spec's own form
        ("post", "/v1/workers"): {
            "id": "bad-input-w",
            "pool": "preemptible",
            "engine": "hf",
            "slots": 4,
        },
        ("post", "/v1/workers/{worker_id}/release"): {"count": 1},
        ("post", "/v1/models/{model}/versions/{version}/commit"): {
            "files": [{"name": "a.bin", "size": 1, "sha256": "0" * 64}],
            "metadata": {"k": 1.5},
        },
        ("post", "/v1/content/have"): {"sha256": ["0" * 64]},
    }


SPOILERS = ["NaN", "Infinity", "-Infinity", "1e400", DIGITS, "9" * 5000, json.dumps(LONG[:50_000])]


def spoiled(body: dict) -> list[tuple[str, bytes]]:
    """(what, raw JSON) for each field of `body` (and of its nested objects) set to each spoiler."""
    marker = "__SPOILED__"
    out = []

    def walk(node, where):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            node[key] = marker
            text = json.dumps(body)
            for bad in SPOILERS:
                out.append((f"{where}.{key}={bad[:12]}", text.replace(f'"{marker}"', bad).encode()))
            node[key] = value
            if isinstance(value, dict | list):
                walk(value, f"{where}.{key}")

    walk(body, "body")
    return out


def test_every_route_refuses_bad_input_and_nothing_changes(
    deployment, services, finished_run, rdb, tiny_model, tmp_path
):
    run_id = finished_run["id"]
    worker = deployment.workers()[0].name
    ws = services["weightstore"]
    manifest = httpx.get(f"{ws}/v1/models/{run_id}/latest", timeout=10).json()
    good = {
        "run_id": run_id,
        "worker_id": worker,
        "model": run_id,
        "version": str(manifest["version"]),
        "name": manifest["files"][0]["name"],
    }
    weights_root = deployment.work_dir / "weights"
    files_before = files_under(weights_root)
    before = redis_snapshot(rdb)
    bodies = valid_bodies(tiny_model)
    listed = {name: routes(url) for name, url in services.items()}
    assert {len(v) > 0 for v in listed.values()} == {True}
    cases = 0
    for name, url in services.items():
        for method, template, op in listed[name]:
            path = fill(template, good)
            params = op.get("parameters", [])
            has_body = "requestBody" in op
            if has_body:
                assert (method, template) in bodies, f"no valid body for {method} {template}"
            write = method in WRITES
            body = bodies.get((method, template))
            kwargs = {"json": body} if body is not None else {}

            # declared oversized: refused before the body (401 first for a write without token)
            status, text, _ = raw_exchange(url, method, path, {}, HUGE, send_body=False)
            assert status == (401 if write else 413), (method, path, status)
            assert_refused(url, status, text, (method, path, "declared"))
            status, text, _ = raw_exchange(url, method, path, AUTH, HUGE, send_body=False)
            assert status == 413, (method, path, status, text)
            assert_refused(url, status, text, (method, path, "declared, token"))
            cases += 2

            if write:  # unauthenticated writes: 401 whatever the body
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                    resp = httpx.request(method, url + path, headers=headers, timeout=10, **kwargs)
                    assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
                    cases += 1
                # a streamed body past the route's limit is cut off (an upload: to a version
                # not committed, so that the store reads it)
                too_much = 2 * MAX_FILE_BYTES if method == "put" else 2 * 1024 * 1024
                target = fill(template, good | {"version": "9"})
                status, text, _ = raw_exchange(url, method, target, AUTH, too_much, chunked=True)
                assert_refused(url, status, text, (method, path, "chunked"))
                cases += 1

            for param in params:  # path and query parameters: long, huge, not numbers
                where = param["in"]
                if where not in ("path", "query"):
                    continue
                numeric = param.get("schema", {}).get("type") in ("integer", "number", "boolean")
                # NaN and Infinity are names like any other where a name is asked for
                spoilers = ["NaN", "Infinity"] if numeric else []
                for bad in (URL_LONG, DIGITS, "-1", "%ff%fe", *spoilers):
                    if where == "path":
                        target = fill(template, good | {param["name"]: bad})
                        resp = httpx.request(
                            method, url + target, headers=AUTH, timeout=10, **kwargs
                        )
                    else:
                        resp = httpx.request(
                            method,
                            url + path,
                            params={param["name"]: bad},
                            headers=AUTH,
                            timeout=10,
                            **kwargs,
                        )
                    what = (method, template, param["name"], bad[:10])
                    assert_refused(url, resp.status_code, resp.content, what)
                    cases += 1

            if body is not None:  # every field of the body spoiled in turn
                for what, raw in spoiled(json.loads(json.dumps(body))):
                    resp = httpx.request(
                        method,
                        url + path,
                        content=raw,
                        headers=AUTH | {"content-type": "application/json"},
                        timeout=10,
                    )
                    assert_refused(url, resp.status_code, resp.content, (method, path, what))
                    cases += 1
                for raw in (b"[" * 10_000 + b"]" * 10_000, b"{not json", b'"' + SECRET.encode()):
                    resp = httpx.request(
                        method,
                        url + path,
                        content=raw,
                        headers=AUTH | {"content-type": "application/json"},
                        timeout=10,
                    )
                    assert_refused(url, resp.status_code, resp.content, (method, path, raw[:10]))
                    cases += 1
    assert cases > 200, cases
    assert redis_snapshot(rdb) == before
    assert files_under(weights_root) == files_before


def test_a_stranger_s_big_upload_costs_nearly_nothing(deployment, services, finished_run):
    """300 MB without the token: refused at the headers; the server reads almost none of it."""
    for name, method, path in (
        ("coordinator", "post", "/v1/runs"),
        ("weightstore", "put", f"/v1/models/{finished_run['id']}/versions/9/files/a.bin"),
    ):
        url = services[name]
        proc = psutil.Process(deployment.procs[name].pid)
        rss_before = proc.memory_info().rss
        for chunked in (False, True):
            status, body, sent = raw_exchange(url, method, path, {}, HUGE, chunked=chunked)
            assert status == 401, (name, chunked, body)
            assert sent < 32 * 1024 * 1024, (name, chunked, sent)  # what the socket buffers took
        assert proc.memory_info().rss - rss_before < 32 * 1024 * 1024
        healthy(url)


def test_submit_checks_every_file_it_names(deployment, services, rdb, tiny_model, tmp_path):
    url = f"{services['coordinator']}/v1/runs"
    before = (rdb.zcard(keys.RUN_INDEX), rdb.llen(keys.RUN_QUEUE))
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(SECRET.encode() + b"\n\xff\xfe" + SECRET.encode() + b"\n")
    big = tmp_path / "big.jsonl"
    big.write_text('{"question": "1+1?", "answer": "2"}\n')
    math = {"task": "math"}
    cases = [
        (
            small_spec(tiny_model, **math, task_path=str(tmp_path / "none.jsonl")),
            400,
            "does not exist",
        ),
        (small_spec(tiny_model, **math, task_path=str(tmp_path)), 400, "is a directory"),
        (small_spec(tiny_model, **math, task_path=str(binary)), 400, "is not UTF-8 text"),
        (small_spec(tmp_path / ("m" * 4000)), 400, "File name too long"),
        (small_spec(tiny_model / LONG[:5000]), 422, "at most 4096 characters"),
        (small_spec(str(tiny_model) + LONG), 413, "limit"),
        (
            small_spec(tiny_model, prompts_per_step=8192, group_size=256),
            422,
            "SPOTRL_MAX_STEP_REQUESTS",
        ),
        (
            small_spec(tiny_model, prompts_per_step=1024, group_size=16, max_new_tokens=16384),
            422,
            "SPOTRL_MAX_STEP_TOKENS",
        ),
    ]
    for spec, status, says in cases:
        resp = httpx.post(url, json=spec, headers=AUTH, timeout=30)
        assert resp.status_code == status and says in resp.text, (status, resp.text[:300])
        assert_refused(services["coordinator"], resp.status_code, resp.content, says)
    assert (rdb.zcard(keys.RUN_INDEX), rdb.llen(keys.RUN_QUEUE)) == before


@pytest.mark.parametrize(
    "module", ["coordinator", "weightstore", "trainer", "rollout"], ids=lambda m: m
)
def test_no_token_off_loopback_refuses_to_start(module, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTRL_")}
    env |= {"SPOTRL_HOST": "0.0.0.0", "SPOTRL_PORT": str(procs.free_port())}
    env |= {"SPOTRL_ROOT": str(tmp_path / "w"), "SPOTRL_WORK_DIR": str(tmp_path / "t")}
    done = subprocess.run(
        [sys.executable, "-m", f"services.{module}.main"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "SPOTRL_API_TOKEN" in done.stderr and "0.0.0.0" in done.stderr, done.stderr[-2000:]
    assert "Uvicorn running" not in done.stderr


def run_keys_bytes(rdb, run_id: str) -> dict[bytes, int]:
    return {
        k: rdb.memory_usage(k) or 0 for k in rdb.scan_iter(match=f"{keys.run(run_id)}*", count=1000)
    }


def test_a_finished_run_keeps_its_record_not_its_scratch(rdb, finished_run):
    run_id = finished_run["id"]
    left = {k.decode() for k in run_keys_bytes(rdb, run_id)}
    assert keys.jobs_stream(run_id, 0) not in left
    assert not any(":requests" in k or ":tokens:" in k or ":meta" in k for k in left), left
    for kept in (keys.run(run_id), keys.run_version(run_id), keys.run_step(run_id, 0)):
        assert kept in left
    assert keys.run_events(run_id) in left and keys.trainer_state(run_id) in left
    assert 0 < rdb.ttl(keys.groups_stream(run_id)) <= 600  # audits read it for a while


def test_a_cancelled_big_run_leaves_less_than_a_megabyte(
    deployment, services, client, rdb, tiny_model
):
    """4096 prompts x 16 responses (the default cap) cancelled mid-step: the jobs, request
    tables and streams of the run go; the services keep going and the next run trains."""
    spec = small_spec(tiny_model, prompts_per_step=4096, group_size=16, max_new_tokens=2, steps=2)
    run_id = client.submit(spec)
    deadline = time.monotonic() + 180
    while True:  # mid-step: the jobs queued, tokens coming back
        assert time.monotonic() < deadline, "the big step never got going"
        deployment.check_alive()
        if len(collected(rdb, run_id, 0)) > 5:  # responses of the step are being stored
            break
        time.sleep(0.1)
    assert sum(run_keys_bytes(rdb, run_id).values()) > 4 * 1024 * 1024
    assert client.cancel(run_id)["state"] == "cancelled"
    wait_idle(deployment, services, rdb)  # everyone has moved off the run
    # the coordinator cleaned up twice: at the cancel, and once the run's manager had stopped
    coordinator_log = deployment.procs["coordinator"].log_path
    deadline = time.monotonic() + 60
    while coordinator_log.read_text().count(f"run {run_id} (cancelled): ") < 2:
        assert time.monotonic() < deadline, "the coordinator never settled the cancelled run"
        time.sleep(0.1)
    left = run_keys_bytes(rdb, run_id)
    assert sum(left.values()) < 1024 * 1024, left
    assert keys.jobs_stream(run_id, 0).encode() not in left
    assert keys.run(run_id).encode() in left
    assert client.run(run_id)["state"] == "cancelled"  # not turned into a failure
    for url in services.values():
        healthy(url)
    deployment.check_alive()
    after = wait_final(client, deployment, client.submit(small_spec(tiny_model, steps=1)))
    assert after["state"] == "succeeded", after
    assert after["state"] in FINAL_STATES

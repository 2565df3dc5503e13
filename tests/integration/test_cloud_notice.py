"""Cloud preemption notices outside Kubernetes: a metadata server started here, on 127.0.0.1,
answers in each cloud's documented format (AWS IMDSv2 with its session token, GCP's preempted
flag, Azure's scheduled events, with another VM's preemption and a maintenance event of ours
listed beforehand); a real rollout worker watches it in a real run. When the server says
"preempted", the worker leaves as on SIGTERM: it releases what it holds (cause preemption), says
it left with notice, exits, and the run ends exact. Nothing here contacts a real metadata
address: every worker is pointed at the local server."""

import asyncio
import contextlib
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from services.cli import procs
from services.cli.audit import audit_run
from services.cli.procs import Proc
from services.contracts.runspec import RunSpec
from services.rollout.cloud_notice import MAX_ANSWER_BYTES, Notice
from services.rollout.notice import NoticeWatcher
from services.rollout.settings import RolloutSettings
from tests.integration.conftest import (
    holds_unfinished_jobs,
    run_events,
    short_heartbeat_config,
    small_spec,
    wait_final,
    wait_until,
)

VM_NAME = "spot-vm-1"
POLL_S = 0.2
GRACE_S = 5.0
AWS_NOTICE_S, AZURE_NOTICE_S = 120, 30  # how far ahead each cloud says its VM goes


@dataclass
class MetadataState:
    """What the local metadata service answers; changed by the test, read by the server."""

    preempted: bool = False
    broken: str = ""  # "": answer properly; "500", "garbage" or "huge": answer that instead
    tokens: set[str] = field(default_factory=set)  # AWS session tokens handed out
    seen: list[str] = field(default_factory=list)  # "METHOD path status" of every request
    lock: threading.Lock = field(default_factory=threading.Lock)


class MetadataHandler(BaseHTTPRequestHandler):
    """AWS, GCP and Azure metadata paths, each checking its cloud's header."""

    server: "MetadataServer"

    def log_message(self, format: str, *args: object) -> None:
        return  # quiet: the state records what was asked

    def answer(self, status: int, body: bytes | str, kind: str = "text/plain") -> None:
        data = body.encode() if isinstance(body, str) else body
        with self.server.state.lock:
            self.server.state.seen.append(f"{self.command} {self.path} {status}")
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if self.path != "/latest/api/token":
            return self.answer(404, "Not Found")
        if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return self.answer(400, "Bad Request")
        token = secrets.token_urlsafe(24)
        self.server.state.tokens.add(token)
        self.answer(200, token)

    def do_GET(self) -> None:
        state = self.server.state
        if state.broken == "500":
            return self.answer(500, "Internal Server Error")
        if state.broken == "garbage":
            return self.answer(200, "<html>captive portal</html>", "text/html")
        if state.broken == "huge":
            return self.answer(200, b"x" * (MAX_ANSWER_BYTES + 1))
        if self.path == "/latest/meta-data/spot/instance-action":
            return self.aws()
        if self.path == "/computeMetadata/v1/instance/preempted":
            return self.gcp()
        if self.path.startswith("/metadata/"):
            return self.azure()
        self.answer(404, "Not Found")

    def aws(self) -> None:
        if self.headers.get("X-aws-ec2-metadata-token") not in self.server.state.tokens:
            return self.answer(401, "")
        if not self.server.state.preempted:
            return self.answer(404, "Not Found")
        goes = time.gmtime(time.time() + AWS_NOTICE_S)
        body = {"action": "terminate", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", goes)}
        self.answer(200, json.dumps(body), "application/json")

    def gcp(self) -> None:
        if self.headers.get("Metadata-Flavor") != "Google":
            return self.answer(403, "Missing Metadata-Flavor:Google header.")
        self.answer(200, "TRUE" if self.server.state.preempted else "FALSE")

    def azure(self) -> None:
        if self.headers.get("Metadata") != "true":
            return self.answer(400, '{"error": "Required metadata header not specified"}')
        if self.path == "/metadata/instance/compute/name?api-version=2021-02-01&format=text":
            return self.answer(200, VM_NAME)
        if self.path != "/metadata/scheduledevents?api-version=2020-07-01":
            return self.answer(404, "Not Found")

        def event(n: int, kind: str, vm: str) -> dict:
            return {
                "EventId": f"event-{n}",
                "EventType": kind,
                "ResourceType": "VirtualMachine",
                "Resources": [vm],
                "EventStatus": "Scheduled",
                "NotBefore": formatdate(time.time() + AZURE_NOTICE_S, usegmt=True),
                "Description": "",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            }

        # another VM of the scale set is preempted, ours only frozen: no notice of ours
        events = [event(1, "Preempt", "spot-vm-2"), event(2, "Freeze", VM_NAME)]
        if self.server.state.preempted:
            events.append(event(3, "Preempt", VM_NAME))
        body = {"DocumentIncarnation": len(events), "Events": events}
        self.answer(200, json.dumps(body), "application/json")


class MetadataServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), MetadataHandler)
        self.state = MetadataState()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@contextlib.contextmanager
def serving() -> Iterator[MetadataServer]:
    server = MetadataServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
def metadata() -> Iterator[MetadataServer]:
    with serving() as server:
        yield server


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, MetadataServer]]:
    """One local metadata service per cloud, each with its own state."""
    with serving() as aws, serving() as gcp, serving() as azure:
        yield {"aws": aws, "gcp": gcp, "azure": azure}


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory):
    """No worker of its own: the test adds one watcher per cloud, then one plain worker."""
    return short_heartbeat_config(tmp_path_factory.mktemp("cloud-notice"), 0, grace_s=GRACE_S)


def test_the_local_server_checks_the_imdsv2_token(metadata):
    path = f"{metadata.url}/latest/meta-data/spot/instance-action"
    assert httpx.get(path).status_code == 401
    assert httpx.get(path, headers={"X-aws-ec2-metadata-token": "made-up"}).status_code == 401
    ttl = {"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    token = httpx.put(f"{metadata.url}/latest/api/token", headers=ttl).text
    assert httpx.get(path, headers={"X-aws-ec2-metadata-token": token}).status_code == 404


def watch(
    metadata: MetadataServer, cloud: str
) -> tuple[list[Notice], NoticeWatcher, threading.Thread]:
    """A watcher of the local server, run in a thread of this process until its notice."""
    settings = RolloutSettings(
        cloud_notice=cloud, cloud_notice_url=metadata.url, cloud_notice_interval_s=0.1
    )
    noticed: list[Notice] = []
    watcher = NoticeWatcher(settings, on_notice=noticed.append)

    async def until_noticed() -> None:
        async with asyncio.timeout(30):
            await watcher.run_forever()

    thread = threading.Thread(target=asyncio.run, args=(until_noticed(),))
    thread.start()
    return noticed, watcher, thread


def test_a_failing_metadata_service_is_logged_and_retried_never_fatal(metadata, caplog):
    caplog.set_level(logging.WARNING, logger="services.rollout.notice")
    metadata.state = MetadataState(broken="500")
    noticed, watcher, thread = watch(metadata, "aws")
    for broken in ("500", "garbage", "huge"):
        metadata.state.broken = broken
        seen = len(metadata.state.seen)
        wait_until(lambda s=seen: len(metadata.state.seen) >= s + 3, f"no polls while {broken}")
    metadata.state.broken = ""
    metadata.state.tokens.clear()  # the tokens it holds expire: it must ask for a new one
    metadata.state.preempted = True
    wait_until(lambda: noticed, "the watcher never saw the notice")
    thread.join(10)
    assert not thread.is_alive()  # it returned after its one notice
    assert [n.action for n in noticed] == ["terminate"]
    assert not watcher.pace.left_out  # recovered before the notice
    failures = [r for r in caplog.records if "metadata poll failed" in r.getMessage()]
    assert failures and len(failures) < watcher.polls  # paced: not one line per poll
    assert any("unexpected HTTP 500" in r.getMessage() for r in failures)
    asked = metadata.state.seen
    assert any(s.endswith("instance-action 401") for s in asked)  # its expired token...
    assert asked[-1].endswith("instance-action 200")  # ...renewed, then the notice


@dataclass
class NoticedRun:
    run_id: str
    body: dict
    watchers: dict[str, Proc]  # by cloud


@pytest.fixture(scope="module")
def noticed_run(deployment, client, rdb, tiny_model, servers) -> NoticedRun:
    """One run, three workers each watching its cloud's local metadata service and nothing
    else generating: as each is seen mid-generation, its cloud says "preempted"; once all three
    have left, a plain worker finishes the run."""
    watchers = {
        cloud: deployment.add_worker(
            "preemptible",
            wait=False,
            cloud_notice=cloud,
            cloud_notice_url=server.url,
            cloud_notice_interval_s=str(POLL_S),
        )
        for cloud, server in servers.items()
    }
    procs.wait_healthy(list(watchers.values()))
    body = small_spec(tiny_model, steps=1, prompts_per_step=6, max_new_tokens=40, ignore_eos=True)
    run_id = client.submit(body)

    def preempt_those_generating() -> bool:
        for cloud, proc in watchers.items():
            state = servers[cloud].state
            if not state.preempted and state.seen and holds_unfinished_jobs(rdb, run_id, proc.name):
                state.preempted = True
        return all(server.state.preempted for server in servers.values())

    def waiting() -> str:
        return f"never seen generating: {[c for c, v in servers.items() if not v.state.preempted]}"

    wait_until(preempt_those_generating, waiting, 120)
    for proc in watchers.values():
        proc.popen.wait(GRACE_S + 30)  # each leaves on its own: nobody sent it a signal
    deployment.add_worker("preemptible", wait=False)
    return NoticedRun(run_id, body, watchers)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_a_cloud_notice_takes_the_sigterm_path(noticed_run, rdb, servers, cloud):
    proc = noticed_run.watchers[cloud]
    assert proc.popen.returncode is not None and not proc.stopped_on_purpose
    log = proc.log_path.read_text()
    assert f"preemption notice from {cloud}:" in log, log[-3000:]
    if cloud != "gcp":  # the deadline its cloud stated, as seconds left when it was seen
        left_s = re.search(rf"notice from {cloud}: .*deadline .* \(in (-?\d+)s\)", log)
        stated_s = AWS_NOTICE_S if cloud == "aws" else AZURE_NOTICE_S
        assert left_s and stated_s - 10 <= int(left_s.group(1)) <= stated_s, log[-3000:]
    released = re.search(r"preemption notice: released (\d+) requests", log)
    assert released and int(released.group(1)) >= 1, log[-3000:]
    left = wait_until(
        lambda: [
            e
            for e in run_events(rdb, noticed_run.run_id, "worker_left")
            if e["worker"] == proc.name
        ],
        "the coordinator never saw the worker leave",
    )
    assert left[0]["cause"] == "notice"  # its leaving key: the same as on SIGTERM
    if cloud == "aws":  # the server refuses a GET without a valid token: it always had one
        assert not [s for s in servers[cloud].state.seen if s.endswith(" 401")]


def test_the_noticed_run_ends_exact(noticed_run, deployment, client):
    run = wait_final(client, deployment, noticed_run.run_id, timeout_s=180)
    assert run["state"] == "succeeded", run
    spec = RunSpec.model_validate(noticed_run.body)
    audit = audit_run(deployment.redis_url, noticed_run.run_id, spec)
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
    migrations = client.metrics(noticed_run.run_id)[0]["migrations"]
    assert migrations.get("preemption", 0) >= len(noticed_run.watchers), migrations
    assert migrations.get("death", 0) == 0, migrations  # every one left with notice

"""Least privilege, end to end (issue 41): every service on its own Redis user and API token,
every hop over TLS, a run that loses and duplicates nothing; then, holding only what a rollout
worker holds (the worker token, the Redis user the coordinator minted for it at registration,
its signing key), every forbidden thing is tried and refused, and nothing changes.

The tests run in file order on one deployment: the run, then forged deltas during a second run,
then a run of its own and the forbidden list with the workers stopped (so that no heartbeat
changes a key between the two snapshots compared).
"""

import re
from pathlib import Path

import httpx
import pytest
import redis

from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.cli.redis_client import open_redis
from services.contracts import keys
from services.contracts.messages import DeltaBatch, DeltaItem, RequestLease
from services.contracts.runspec import RunSpec
from services.infra import signing
from services.infra.tls import ca_verify
from tests.harness.deploy import DeploymentConfig
from tests.integration.conftest import (
    deploy_config,
    read_groups,
    small_spec,
    wait_final,
    wait_until,
)

pytestmark = pytest.mark.slow
# a sequence no run makes by chance: found at the start of a trained response = accepted
FORGED = [7, 3, 9, 1, 8, 2, 6, 4, 7, 3, 9, 1]
INTRUDER = "intruder-1"


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return deploy_config(
        tmp_path_factory.mktemp("least-privilege"),
        worker_slots=8,
        secure=True,
        tls=True,
        # reads need a token too; engine steps of 30 ms at least: a run lasts long enough to be
        # written into while it generates
        extra_env={"SPOTRL_PROTECT_READS": "true", "SPOTRL_STEP_DELAY_MS": "30"},
    )


@pytest.fixture(scope="module")
def client(deployment):
    c = CoordinatorClient(
        deployment.coordinator_url, deployment.admin_token, ca_file=deployment.ca_file
    )
    yield c
    c.close()


@pytest.fixture(scope="module")
def operator(deployment):
    """Redis as the coordinator's user: what the test reads to check the state (it may read
    every key the services keep; the reader's user may not read a worker's signing key)."""
    url = deployment.credentials.redis_url(deployment.redis_url, "coordinator")
    r = open_redis(url, deployment.ca_file)
    yield r
    r.close()


@pytest.fixture(scope="module")
def tokens(deployment) -> dict[str, str]:
    return deployment.credentials.tokens


@pytest.fixture(scope="module")
def intruder(deployment, tokens):
    """A worker's credentials, as a worker gets them: the worker token, then registration."""
    body = {"id": INTRUDER, "pool": "preemptible", "engine": "hf", "slots": 4, "url": ""}
    with http(deployment, tokens["worker"]) as h:
        resp = h.post(f"{deployment.coordinator_url}/v1/workers", json=body)
    assert resp.status_code == 201, resp.text
    answer = resp.json()
    assert answer["redis_username"] and answer["redis_password"] and answer["signing_key"]
    host = deployment.redis_url.split("://", 1)[1]
    url = f"rediss://{answer['redis_username']}:{answer['redis_password']}@{host}"
    r = open_redis(url, deployment.ca_file)
    yield r, signing.key_bytes(answer["signing_key"])
    r.close()


def http(deployment, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(headers=headers, verify=ca_verify(deployment.ca_file), timeout=30)


def test_a_run_over_tls_with_a_user_and_token_per_service(deployment, client, operator, tiny_model):
    urls = [deployment.coordinator_url, deployment.trainer_url, *deployment.weightstore_urls]
    assert all(u.startswith("https://") for u in urls)
    assert deployment.redis_url.startswith("rediss://")
    envs = {name: env for name, (_, env, _) in deployment.launch.items()}
    users = {name: redis_user(env["SPOTRL_REDIS_URL"]) for name, env in envs.items()}
    assert users["coordinator"] == "spotrl-coordinator"
    assert users["trainer"] == "spotrl-trainer"
    secrets = [*deployment.credentials.redis_passwords.values()]
    secrets += [deployment.credentials.tokens[s] for s in ("admin", "trainer", "read")]
    for name, env in envs.items():
        if name.startswith("rollout-"):
            assert users[name] is None  # its own user comes from the coordinator
            assert not any(s in v for s in secrets for v in env.values()), name
    # plain HTTP to a TLS port gets no answer; a client without the CA refuses the certificate
    with pytest.raises(httpx.HTTPError):
        httpx.get(deployment.coordinator_url.replace("https://", "http://") + "/healthz")
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(deployment.coordinator_url + "/healthz")

    spec = small_spec(tiny_model, steps=2)
    run_id = client.submit(spec)
    assert_complete(client, deployment, run_id, spec)
    # each worker registered and got a user and signing key of its own
    workers = {p.name for p in deployment.workers()}
    assert workers <= {k.decode() for k in operator.hkeys(keys.WORKER_KEYS)}


def assert_complete(client, deployment, run_id: str, spec: dict) -> None:
    """The run succeeded with no response lost or duplicated (its audit, as the reader)."""
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded", run
    audit = audit_run(
        deployment.reader_redis_url,
        run_id,
        RunSpec.model_validate(spec),
        ca_file=deployment.ca_file,
    )
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit


def redis_user(url: str) -> str | None:
    found = re.match(r"rediss?://([^:@/]*):[^@/]*@", url)
    return found.group(1) if found else None


def test_b_deltas_into_another_workers_lease_are_refused(
    deployment, client, operator, intruder, tiny_model
):
    r, key = intruder
    spec = small_spec(tiny_model, steps=1, max_new_tokens=24, prompts_per_step=4)
    run_id = client.submit(spec)
    stream = keys.deltas_stream(run_id)

    def held() -> list[tuple[str, int]]:
        rows = operator.hgetall(keys.step_requests(run_id, 0))
        return [
            (rid.decode(), int(raw.decode().split("|")[0]))
            for rid, raw in rows.items()
            if not raw.decode().split("|")[1]
        ]

    targets = wait_until(held, "no request of the run is being generated", 120)
    victim = next(p.name for p in deployment.workers())
    # the jobs pending under another worker cannot be read in its name: its consumer name
    # carries a secret (the grants are in the jobs)
    for name in (victim, *(p.name for p in deployment.workers())):
        pending = r.xreadgroup(keys.WORKERS_GROUP, name, {keys.jobs_stream(run_id, 0): "0"})
        assert all(not entries for _, entries in pending), name
    # nor can it register under an alive worker's id to get its user, key and consumer name
    body = {"id": victim, "pool": "preemptible", "engine": "hf", "slots": 4, "url": ""}
    with http(deployment, deployment.credentials.tokens["worker"]) as h:
        taken = h.post(f"{deployment.coordinator_url}/v1/workers", json=body)
    assert taken.status_code == 409, taken.text
    items = [
        DeltaItem(
            request_id=rid,
            lease=lease,
            grant="0" * 16,  # the lease's grant is the secret a worker learns from its job
            offset=0,
            token_ids=FORGED,
            logprobs=[0.0] * len(FORGED),
        )
        for rid, lease in targets
    ]
    releases = [RequestLease(request_id=rid, lease=lease, grant="0" * 16) for rid, lease in targets]
    # 1: its own name, its own key, leases it does not hold: refused item by item
    own = DeltaBatch(worker_id=INTRUDER, version=0, items=items, released=releases)
    signed_add(r, stream, own, key)
    # 2: another worker's name, signed with its own key: the batch is parked whole
    impostor = DeltaBatch(worker_id=victim, version=0, items=items)
    signed_add(r, stream, impostor, key)

    def refused() -> bool:
        text = metrics(deployment)
        return bool(
            counter(text, 'spotrl_coordinator_wrong_grant_total{kind="delta"}') >= len(items)
            and operator.xlen(keys.parked_stream(run_id)) >= 1
        )

    wait_until(refused, lambda: metrics_lines(deployment, "wrong_grant|parked"), 60)
    assert_complete(client, deployment, run_id, spec)
    for group in read_groups(deployment, run_id):
        for response in group.responses:
            assert response.token_ids[: len(FORGED)] != FORGED
    parked = operator.xrange(keys.parked_stream(run_id))
    assert any(b"not signed with the key of worker" in v for _, f in parked for v in f.values())


def signed_add(r: redis.Redis, stream: str, batch: DeltaBatch, key: bytes) -> None:
    payload = batch.encode()
    r.xadd(stream, {b"m": payload, b"s": signing.sign(key, payload)})


def metrics(deployment) -> str:
    with http(deployment, deployment.credentials.tokens["read"]) as h:
        return h.get(f"{deployment.coordinator_url}/metrics").text


def metrics_lines(deployment, pattern: str) -> str:
    return "\n".join(ln for ln in metrics(deployment).splitlines() if re.search(pattern, ln))


def counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def snapshot(r: redis.Redis) -> dict[bytes, bytes | None]:
    """A DUMP of every key (their values and types, byte for byte)."""
    return {k: r.dump(k) for k in sorted(r.scan_iter(count=1000))}


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_c_a_worker_can_generate_and_nothing_more(
    deployment, client, operator, intruder, tokens, tiny_model
):
    r, _ = intruder
    # a run of its own, finished, whose keys the intruder then tries: in three fresh-clone CIs
    # the earlier tests' runs were not in this deployment's Redis by now (cause not found; the
    # same tests in this file alone always found them)
    spec = small_spec(tiny_model, steps=1)
    run_id = client.submit(spec)
    assert_complete(client, deployment, run_id, spec)
    other_worker = next(p.name for p in deployment.workers())
    for proc in deployment.workers():  # nothing beats or writes while the snapshots are taken
        proc.stop()
    wait_until(
        lambda: not list(operator.scan_iter(keys.worker_heartbeat("*"))),
        "a stopped worker's heartbeat key outlived its TTL",
        30,
    )
    # and the coordinator wrote what it writes of a worker gone (its `worker_left` events,
    # then `gone_since`): in a CI it did so after the first snapshot
    stopped = [proc.name for proc in deployment.workers()]
    wait_until(
        lambda: all(operator.hget(keys.worker(w), "gone_since") for w in stopped),
        "the coordinator never marked the stopped workers gone",
        30,
    )
    before = snapshot(operator)
    store = Path(deployment.work_dir) / "weights"
    store_before = files(store)

    version = int(operator.get(keys.run_version(run_id)) or 0)
    forbidden = {
        "FLUSHALL": lambda: r.flushall(),
        "CONFIG SET": lambda: r.config_set("maxmemory", "1"),
        "KEYS": lambda: r.keys("*"),
        "write a group": lambda: r.xadd(keys.groups_stream(run_id), {b"m": b"x"}),
        "announce a version": lambda: r.set(keys.run_version(run_id), version + 1),
        "announce on the stream": lambda: r.xadd(keys.version_announced(run_id), {b"v": b"9"}),
        "delete a run": lambda: r.delete(keys.run(run_id)),
        "read a run's prompts": lambda: r.hget(keys.run(run_id), "spec"),
        "read the trained groups": lambda: r.xrange(keys.groups_stream(run_id)),
        "read others' jobs": lambda: r.xrange(keys.jobs_stream(run_id, 0)),
        "another worker's heartbeat": lambda: r.set(keys.worker_heartbeat(other_worker), b"x"),
        "another worker's control": lambda: r.xadd(keys.worker_control(other_worker), {b"m": b"x"}),
        "the signing keys": lambda: r.hgetall(keys.WORKER_KEYS),
        "a script": lambda: r.eval("return 1", 0),
    }
    for what, attempt in forbidden.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
            pytest.fail(f"{what}: allowed")

    co, ws = deployment.coordinator_url, deployment.weightstore_urls[0]
    file_url = f"{ws}/v1/models/{run_id}/versions/{version + 1}/files/model.safetensors"
    with http(deployment, tokens["worker"]) as h:
        answers = {
            "submit a run": h.post(f"{co}/v1/runs", json={"model": "/x", "task": "arithmetic"}),
            "cancel a run": h.post(f"{co}/v1/runs/{run_id}/cancel"),
            "read a run": h.get(f"{co}/v1/runs/{run_id}"),
            "drain a worker": h.post(f"{co}/v1/workers/{other_worker}/release", json={"count": 1}),
            "forget a worker": h.delete(f"{co}/v1/workers/{other_worker}"),
            "upload weights": h.put(file_url, content=b"\0" * 1024),
            "commit weights": h.post(
                f"{ws}/v1/models/{run_id}/versions/{version + 1}/commit", json={"files": []}
            ),
        }
    refused = {what: a.status_code for what, a in answers.items() if a.status_code != 403}
    assert not refused, refused
    assert all(len(a.content) < 200 for a in answers.values())

    assert snapshot(operator) == before
    assert files(store) == store_before

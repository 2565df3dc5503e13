"""A rollout worker's own Redis user and signed delta batches (issue 41, parts 1 and 4), with
real processes: a deployment with a Redis user per role and the default user off
(`DeploymentConfig(secure=True)`: the coordinator has `worker_redis_users` on, a worker's
environment holds no Redis password at all).

- A run completes with a real worker that registered, connected as the user the coordinator
  minted for it and signed every batch (an unsigned one would have been parked).
- Holding only what registration answered (over HTTP, with the worker token), a client can
  heartbeat and add a signed batch that the coordinator applies; a batch signed with another
  key, one claiming another worker's id and an unsigned one are parked with the reason, and
  none of their tokens are applied.
- Registering again gives a new password and key (the old password logs in no more); DELETE
  /v1/workers/{id} drops the user and the key.
- The releases the coordinator itself writes for a dead worker (to another shard) carry its own
  signature and pass.
"""

import asyncio
import secrets
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.contracts import keys
from services.contracts.messages import FIELD, DeltaBatch, DeltaItem, Job
from services.contracts.runspec import RunSpec
from services.contracts.shards import shard_of
from services.coordinator.workers.keys import COORDINATOR, WorkerKeys
from services.infra.redis_streams import Read, connect, read_entries
from services.infra.signing import SIGNATURE_FIELD, key_bytes, new_key, registration_proof, sign
from services.infra.tls import ca_verify
from tests import factories
from tests.harness.deploy import DeploymentConfig

from .conftest import collected, deploy_config, small_spec, wait_final, wait_until

WORKER = "rollout-preemptible-1"  # the deployment's one worker


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return deploy_config(
        tmp_path_factory.mktemp("worker-users"),
        reserved=0,
        secure=True,
    )


@pytest.fixture(scope="module")
def client(deployment):
    with CoordinatorClient(deployment.coordinator_url, deployment.admin_token) as c:
        yield c


@pytest.fixture(scope="module")
def rdb(deployment):
    """Redis as the coordinator's user: it alone may read the workers' keys."""
    url = deployment.credentials.redis_url(deployment.redis_url, "coordinator")
    r = redis.Redis.from_url(url)
    yield r
    r.close()


def register(deployment, worker_id: str, proof: str | None = None, status: int = 201) -> dict:
    """POST /v1/workers with the worker token, as a worker does; the answer."""
    body = {"id": worker_id, "pool": "preemptible", "engine": "hf", "slots": 4}
    if proof is not None:
        body["proof"] = proof
    token = deployment.credentials.tokens["worker"]
    resp = httpx.post(
        f"{deployment.coordinator_url}/v1/workers",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
        verify=ca_verify(deployment.ca_file),
    )
    assert resp.status_code == status, resp.text
    return resp.json()


def connect_as(deployment, answer: dict) -> redis.Redis:
    """Redis as the user registration answered (the deployment's host and port)."""
    where = urlsplit(deployment.redis_url)
    return redis.Redis(
        host=where.hostname,
        port=where.port,
        username=answer["redis_username"],
        password=answer["redis_password"],
        socket_timeout=10,
    )


def beat(r: redis.Redis, worker_id: str, run_id: str | None) -> None:
    """The heartbeat a worker serving `run_id` at version 0 writes (alive for a minute)."""
    hb = factories.beat(worker_id, "preemptible", 0, run_id=run_id, slots=4)
    r.set(keys.worker_heartbeat(worker_id), hb.encode(), px=60_000)


def entry(worker_id: str, job: Job, key: bytes | None) -> dict[bytes, bytes | str]:
    """A deltas entry of one new token of `job`, in `worker_id`'s name, signed with `key`."""
    item = DeltaItem(
        request_id=job.request_id,
        lease=job.lease,
        grant=job.grant,
        offset=0,
        token_ids=[5],
        logprobs=[-1.0],
    )
    message = DeltaBatch(worker_id=worker_id, version=0, items=[item]).encode()
    fields: dict[bytes, bytes | str] = {FIELD: message}
    if key is not None:
        fields[SIGNATURE_FIELD] = sign(key, message)
    return fields


def test_a_run_completes_with_its_worker_on_its_own_user(deployment, client, rdb, tiny_model):
    body = small_spec(tiny_model, steps=2)
    run_id = client.submit(body)
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded", run["error"]
    audit = audit_run(deployment.reader_redis_url, run_id, RunSpec.model_validate(body))
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
    assert rdb.xlen(keys.parked_stream(run_id)) == 0  # every batch checked out
    assert len(rdb.hget(keys.WORKER_KEYS, WORKER) or b"") == 64  # 32 bytes, hex
    log = deployment.procs[WORKER].log_path.read_text()
    assert f"Redis user spotrl-worker-{WORKER}" in log


def test_only_batches_signed_by_the_worker_they_name_are_applied(
    deployment, client, rdb, tiny_model
):
    deployment.procs[WORKER].stop()  # the jobs of the next run wait for the test to read
    intruder = register(deployment, "intruder")
    assert intruder["redis_username"] == "spotrl-worker-intruder"
    register(deployment, "victim")  # another worker, with a key of its own
    own_key = key_bytes(intruder["signing_key"])
    r = connect_as(deployment, intruder)
    beat(r, "intruder", None)  # the user may write its heartbeat before any run
    run_id = client.submit(small_spec(tiny_model, steps=1, prompts_per_step=2, group_size=2))
    try:
        beat(r, "intruder", run_id)
        jobs_stream = keys.jobs_stream(run_id, 0)
        wait_until(lambda: rdb.exists(jobs_stream) and rdb.xlen(jobs_stream) >= 4, "no jobs")
        reply = r.xreadgroup(keys.WORKERS_GROUP, "intruder", {jobs_stream: ">"}, count=4)
        jobs = [Job.from_fields(fields) for _, fields in read_entries(reply)]
        assert len(jobs) == 4
        signed, other_key, claimed, unsigned = jobs
        sent = [
            entry("intruder", signed, own_key),
            entry("intruder", other_key, secrets.token_bytes(32)),
            entry("victim", claimed, own_key),
            entry("intruder", unsigned, None),
        ]
        for fields, job in zip(sent, jobs, strict=True):
            r.xadd(keys.deltas_stream(run_id, shard_of(job.request_id, job.shards)), fields)
        parked = keys.parked_stream(run_id)
        wait_until(
            lambda: signed.request_id in collected(rdb, run_id, 0) and rdb.xlen(parked) >= 3,
            lambda: f"applied {collected(rdb, run_id, 0)}, parked {rdb.xrange(parked)}",
        )
        assert set(collected(rdb, run_id, 0)) == {signed.request_id}
        reasons = sorted(fields[b"reason"].decode() for _, fields in rdb.xrange(parked))
        assert reasons == [
            "delta batch not signed with the key of worker intruder",
            "delta batch not signed with the key of worker victim",
            "unsigned delta batch (worker intruder)",
        ]
    finally:
        client.cancel(run_id)
        r.delete(keys.worker_heartbeat("intruder"))
        r.close()


def test_registering_again_renews_the_user_and_forgetting_drops_it(deployment, rdb):
    first = register(deployment, "leaver")
    second = register(deployment, "leaver")  # a restart under the same id
    assert second["redis_username"] == first["redis_username"]
    assert second["redis_password"] != first["redis_password"]
    assert second["signing_key"] != first["signing_key"]
    assert rdb.hget(keys.WORKER_KEYS, "leaver").decode() == second["signing_key"]
    with pytest.raises(redis.AuthenticationError):
        connect_as(deployment, first).ping()
    r = connect_as(deployment, second)
    beat(r, "leaver", None)
    r.delete(keys.worker_heartbeat("leaver"))  # gone: it may be forgotten
    r.close()
    resp = httpx.delete(
        f"{deployment.coordinator_url}/v1/workers/leaver",
        headers={"Authorization": f"Bearer {deployment.admin_token}"},
        timeout=10,
    )
    assert resp.status_code == 204, resp.text
    assert rdb.hget(keys.WORKER_KEYS, "leaver") is None
    with pytest.raises(redis.AuthenticationError):
        connect_as(deployment, second).ping()


def test_a_worker_id_that_cannot_name_a_user_is_refused(deployment):
    token = deployment.credentials.tokens["worker"]
    resp = httpx.post(
        f"{deployment.coordinator_url}/v1/workers",
        json={"id": "a:b", "pool": "preemptible", "engine": "hf", "slots": 4},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert resp.status_code == 400 and "cannot have a Redis user" in resp.text


def test_a_batch_the_coordinator_hands_another_shard_is_signed_with_its_own_key(
    empty_redis_url,
):
    """A dead worker's releases that another coordinator shard holds are written by the
    coordinator (`step.leadership.reclaim`) in the dead worker's name: signed with the
    coordinator's own key, they pass every shard's check; the key is made once."""

    async def check() -> None:
        r = connect(empty_redis_url)
        try:
            handed = DeltaBatch(worker_id="w-dead", version=0, items=[])
            written = await WorkerKeys(r).entry(handed)
            made = await r.hget(keys.WORKER_KEYS, COORDINATOR)
            again = await WorkerKeys(r).entry(handed)  # another shard's process
            assert await r.hget(keys.WORKER_KEYS, COORDINATOR) == made
            assert written == again
            forged = {FIELD: handed.encode(), SIGNATURE_FIELD: "00" * 32}
            read: Read[DeltaBatch] = Read(
                [(b"1-0", written), (b"2-0", forged)],
                [(b"1-0", handed), (b"2-0", handed)],
                [],
            )
            await WorkerKeys(r).screen(read)
            assert [entry_id for entry_id, _ in read.messages] == [b"1-0"]
            assert [entry_id for entry_id, _ in read.parked] == [b"2-0"]
        finally:
            await r.aclose()

    asyncio.run(check())


def test_an_alive_id_registers_again_only_with_the_proof_of_its_key(deployment):
    first = register(deployment, "alive-1")
    r = connect_as(deployment, first)
    beat(r, "alive-1", None)  # alive: someone else with the worker token may not take its id
    r.close()
    assert first["consumer"].startswith("alive-1#")
    refused = register(deployment, "alive-1", status=409)
    assert "alive" in refused["detail"]
    wrong = registration_proof(key_bytes(new_key()), "alive-1")
    register(deployment, "alive-1", proof=wrong, status=409)
    proof = registration_proof(key_bytes(first["signing_key"]), "alive-1")
    again = register(deployment, "alive-1", proof=proof)  # its own jobs task, restarted
    assert again["consumer"] == first["consumer"]  # the jobs pending under it stay its own
    assert again["signing_key"] == first["signing_key"]  # what it signed before still counts
    assert again["redis_password"] != first["redis_password"]

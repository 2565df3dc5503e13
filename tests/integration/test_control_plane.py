"""The coordinator's control plane apart from its data plane, with real processes: reads are
answered from the read model with ETags, limited per client (each its own loopback address),
the data plane's metrics relayed once each, and a data plane that dies takes the coordinator
down so that its supervisor restarts both; the run then ends exact."""

import os
import signal
import time

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from services.contracts import keys
from services.contracts.records import RunRecord
from services.state import run_record
from tests.harness.deploy import DeploymentConfig
from tests.integration.conftest import deploy_config, small_spec, wait_final, wait_until

pytestmark = pytest.mark.slow
RATE, BURST = 4, 6  # reads per second, and at once, of one client


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return deploy_config(
        tmp_path_factory.mktemp("control-plane"),
        preemptible=0,
        extra_env={"SPOTRL_READ_RATE_PER_S": str(RATE), "SPOTRL_READ_BURST": str(BURST)},
    )


def reader(deployment, address: str) -> httpx.Client:
    """A client of the coordinator from its own loopback address."""
    transport = httpx.HTTPTransport(local_address=address)
    return httpx.Client(base_url=deployment.coordinator_url, transport=transport, timeout=10)


def test_reads_over_a_clients_rate_are_429_and_other_clients_and_writes_go_on(deployment):
    with reader(deployment, "127.0.0.2") as greedy, reader(deployment, "127.0.0.3") as other:
        codes = [greedy.get("/v1/runs").status_code for _ in range(BURST + 4)]
        assert codes[:BURST] == [200] * BURST and 429 in codes[BURST:], codes
        refused = greedy.get("/v1/workers")
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert "read rate" in refused.json()["detail"] and len(refused.content) < 200
        assert other.get("/v1/workers").status_code == 200
        # a write is not a read: it gets its own checks (here: an invalid spec)
        assert greedy.post("/v1/runs", json={"steps": 0}).status_code == 422


def test_pollers_revalidate_with_etags_and_see_each_change(deployment, client, tiny_model):
    run_id = client.submit(small_spec(tiny_model, steps=2))
    with reader(deployment, "127.0.0.4") as poller:
        first = poller.get(f"/v1/runs/{run_id}")  # a run written a moment ago is there
        assert first.status_code == 200 and first.headers["cache-control"] == "no-cache"
        etag = first.headers["etag"]
        again = poller.get(f"/v1/runs/{run_id}", headers={"If-None-Match": etag})
        assert again.status_code in (200, 304)  # 200 only if the run changed meanwhile
        if again.status_code == 304:
            assert again.content == b""
        run = wait_final(client, deployment, run_id)
        assert run["state"] == "succeeded"
        done = wait_until(
            lambda: (
                (reply := poller.get(f"/v1/runs/{run_id}")).status_code == 200
                and reply.json()["state"] == "succeeded"
                and reply
            ),
            "the finished run never showed",
            30,
            0.3,
        )
        assert done.headers["etag"] != etag
        unchanged = poller.get(
            f"/v1/runs/{run_id}", headers={"If-None-Match": done.headers["etag"]}
        )
        assert unchanged.status_code == 304
        page = poller.get("/")
        assert poller.get("/", headers={"If-None-Match": page.headers["etag"]}).status_code == 304
        steps = poller.get(f"/v1/runs/{run_id}/metrics").json()["steps"]
        assert [row["step"] for row in steps] == [0, 1]
        timeline = poller.get(f"/v1/runs/{run_id}/timeline").json()
        assert any(event["kind"] == "state" for event in timeline["events"])


def test_metrics_hold_the_data_planes_and_the_control_planes_each_once(deployment):
    with reader(deployment, "127.0.0.5") as scraper:
        text = scraper.get("/metrics").text
    names = [family.name for family in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert "spotrl_coordinator_runs_queued" in names  # the data plane's (the scheduler)
    assert "spotrl_pool_workers" in names  # the data plane's (the observer)
    assert "spotrl_api_reads_refused" in names  # the control plane's own (a counter)


def test_a_data_plane_that_dies_takes_the_coordinator_down_and_the_run_resumes(
    deployment, client, rdb, tiny_model
):
    run_id = client.submit(small_spec(tiny_model, steps=4))
    wait_until(lambda: client.run(run_id)["step"] >= 1, "the run never trained a step", 120, 0.3)
    health = httpx.get(f"{deployment.coordinator_url}/healthz", timeout=10).json()
    assert health["data_plane"]["alive"] and health["read_model_fresh"]
    coordinator = deployment.procs["coordinator"]
    os.kill(health["data_plane"]["pid"], signal.SIGKILL)
    wait_until(lambda: not coordinator.alive(), "the coordinator outlived its data plane", 30)
    coordinator.stopped_on_purpose = True  # its exit was the test's doing
    deployment.restart("coordinator", kill=False)
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded" and run["step"] == 4


def test_a_stored_spec_that_no_longer_validates_hides_its_run_and_never_fails_a_read(
    deployment,
):
    """A run stored by an older version whose spec the current rules refuse: the read model
    leaves it out (and says so in the log) instead of dying on it."""
    r = redis.Redis.from_url(deployment.redis_url)
    record = RunRecord(id="r-old-rules", spec='{"model": ""}', state="succeeded", created_at=1.0)
    with r.pipeline(transaction=True) as pipe:
        run_record.stage_create(pipe, record)
        pipe.zadd(keys.RUN_INDEX, {"r-old-rules": time.time()})
        pipe.execute()
    log = deployment.log_dir / "coordinator.log"
    wait_until(lambda: "r-old-rules: its stored spec does not validate" in log.read_text(), "", 30)
    with reader(deployment, "127.0.0.9") as one:
        listed = one.get("/v1/runs")
        assert listed.status_code == 200
        assert "r-old-rules" not in listed.text
        assert one.get("/healthz").status_code == 200
    r.zrem(keys.RUN_INDEX, "r-old-rules")
    r.close()

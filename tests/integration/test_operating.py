"""Operating a deployment with a token: the CLI drives a run to the end; every service's /metrics
has the figures an operator watches; the run's timeline records workers lost and preempted with
notice; every write without the right token is a 401 that changes nothing; reads can be
protected too. Real processes throughout, killed for real."""

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from services.cli import procs
from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.contracts import keys
from services.contracts.runspec import RunSpec
from tests.harness.deploy import DeploymentConfig

from .conftest import (
    deploy_config,
    read_groups,
    run_events,
    small_spec,
    wait_final,
    wait_until,
)

TOKEN = "op-s3cret"
STEPS = 6


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return deploy_config(
        tmp_path_factory.mktemp("operating"),
        preemptible=3,
        api_token=TOKEN,
        extra_env={
            "SPOTRL_OBSERVE_S": "0.3",
            "SPOTRL_HEARTBEAT_TTL_S": "2",
            "SPOTRL_STEP_DELAY_MS": "60",
        },
    )


@pytest.fixture(scope="module")
def client(deployment):
    with CoordinatorClient(deployment.coordinator_url, TOKEN) as c:
        yield c


def cli_env(deployment, token: str | None) -> dict[str, str]:
    env = {**os.environ, "SPOTRL_COORDINATOR_URL": deployment.coordinator_url}
    env.pop("SPOTRL_API_TOKEN", None)
    if token:
        env["SPOTRL_API_TOKEN"] = token
    return env


def cli(deployment, *args, token=TOKEN, timeout_s=240):
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        env=cli_env(deployment, token),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def scrape(url: str) -> dict[str, list]:
    """Every sample of a service's /metrics, by sample name (`..._total`, `..._count`)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


@pytest.fixture(scope="module")
def finished_run(deployment, client, tiny_model, tmp_path_factory):
    """A run submitted with `spotrl submit`; mid-run one preemptible worker is killed (no notice)
    and one gets SIGTERM (the notice); metrics are scraped while it goes and after."""
    spec = tmp_path_factory.mktemp("spec") / "run.toml"
    body = small_spec(tiny_model, steps=STEPS, max_new_tokens=6, prompts_per_step=4)
    spec.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in body.items()) + "\n")
    follow = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "submit", str(spec), "--follow"],
        env=cli_env(deployment, TOKEN),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_id = follow.stdout.readline().strip()
    rdb = redis.Redis.from_url(deployment.redis_url)
    wait_until(lambda: client.run(run_id)["step"] >= 2, "the run did not reach step 2", 120, 0.2)
    wait_until(  # the observer saw all three preemptible workers serving the run
        lambda: any(s["workers"]["preemptible"] == 3 for s in client.timeline(run_id)["pool"]),
        "no pool sample with three preemptible workers",
        30,
        0.2,
    )
    mid = {"coordinator": scrape(deployment.coordinator_url)}
    victims = [p for name, p in deployment.procs.items() if name.startswith("rollout-preemptible")]
    victims[0].kill()
    victims[1].popen.send_signal(signal.SIGTERM)
    run = wait_final(client, deployment, run_id)
    _, err = follow.communicate(timeout=60)
    wait_until(  # the lost worker is counted once its heartbeat expired
        lambda: (
            {e["worker"] for e in run_events(rdb, run_id, "worker_left")}
            >= {victims[0].name, victims[1].name}
        ),
        lambda: f"workers left: {run_events(rdb, run_id, 'worker_left')}",
        30,
        0.1,
    )
    rdb.close()
    survivors = [p.url for p in deployment.workers() if p.alive()]
    after = {
        "coordinator": scrape(deployment.coordinator_url),
        "trainer": scrape(deployment.trainer_url),
        "weightstore": scrape(deployment.weightstore_url),
        # a worker that generated tokens (in a run this small one of them may have had none)
        "worker": next(
            (m for m in map(scrape, survivors) if "spotrl_rollout_tokens_total" in m),
            {},
        ),
    }
    return {
        "run": run,
        "mid": mid,
        "after": after,
        "lost": victims[0],
        "notice": victims[1],
        "follow": (follow.returncode, err),
    }


def test_cli_follows_the_run_to_the_end_with_a_progress_bar(deployment, finished_run):
    run_id = finished_run["run"]["id"]
    assert finished_run["run"]["state"] == "succeeded"
    code, err = finished_run["follow"]  # `spotrl submit --follow` from submission to the end
    assert code == 0, err
    assert "RL steps" in err and f"{STEPS}/{STEPS}" in err and "succeeded" in err
    done = cli(deployment, "status", run_id)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "succeeded"
    assert "RL steps" in done.stderr and f"{STEPS}/{STEPS}" in done.stderr
    listed = cli(deployment, "status", "--json")
    assert run_id in [r["id"] for r in json.loads(listed.stdout)]


def values(samples, **labels) -> list[float]:
    return [s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items())]


def test_every_service_exports_what_an_operator_watches(finished_run):
    co, tr = finished_run["after"]["coordinator"], finished_run["after"]["trainer"]
    ws, wk = finished_run["after"]["weightstore"], finished_run["after"]["worker"]
    mid = finished_run["mid"]["coordinator"]
    # tokens/s by worker and by pool, from heartbeats
    by_worker = mid["spotrl_worker_tokens_per_second"]
    assert {s.labels["pool"] for s in by_worker} == {"reserved", "preemptible"}
    assert len({s.labels["worker"] for s in by_worker}) == 4
    assert {s.labels["pool"] for s in co["spotrl_pool_tokens_per_second"]} == {
        "reserved",
        "preemptible",
    }
    tokens = wk["spotrl_rollout_tokens_total"]
    assert sum(s.value for s in tokens) > 0 and all("worker" in s.labels for s in tokens)
    # queue depths and active requests
    assert {s.labels["queue"] for s in co["spotrl_queue_depth"]} >= {
        "runs",
        "jobs_waiting",
        "jobs_in_flight",
        "deltas",
        "groups",
    }
    assert "spotrl_coordinator_requests_pending" in co
    assert "spotrl_rollout_active_requests" in wk
    # preemptions by cause, migrations by cause
    preempted = co["spotrl_coordinator_preemptions_total"]
    assert values(preempted, pool="preemptible", cause="lost") == [1.0]
    assert values(preempted, pool="preemptible", cause="notice") == [1.0]
    causes = {s.labels["cause"] for s in co["spotrl_coordinator_migrations_total"]}
    assert causes >= {"preemption", "death", "balance", "seed"}
    # weight pulls: seconds and bytes
    assert values(wk["spotrl_rollout_weight_pull_seconds_count"])[0] >= 1
    assert values(wk["spotrl_rollout_weight_pull_bytes_total"])[0] > 0
    # trainer step time and its wait time; reward
    assert values(tr["spotrl_trainer_step_seconds_count"]) == [float(STEPS)]
    assert "spotrl_trainer_wait_seconds_total" in tr
    assert "spotrl_trainer_last_wait_seconds" in tr
    assert len(values(co["spotrl_coordinator_reward_mean"])) == 1
    assert values(ws["spotrl_weightstore_commits_total"])[0] >= STEPS


def test_timeline_records_steps_and_how_workers_left(client, finished_run):
    run_id = finished_run["run"]["id"]
    tl = client.timeline(run_id)
    kinds = [e["kind"] for e in tl["events"]]
    assert kinds.count("rollout_done") == STEPS and kinds.count("trained") == STEPS
    states = [e["state"] for e in tl["events"] if e["kind"] == "state"]
    assert states == ["running", "succeeded"]
    left = {e["worker"]: e["cause"] for e in tl["events"] if e["kind"] == "worker_left"}
    assert left == {finished_run["lost"].name: "lost", finished_run["notice"].name: "notice"}
    assert tl["pool"], "the observer sampled the pool during the run"
    counts = [s["workers"]["preemptible"] for s in tl["pool"]]
    full = counts.index(3)  # all three serving the run...
    assert min(counts[full:]) <= 2  # ...then fewer: the one with notice left at once
    newer = client.timeline(run_id, after_event=tl["events"][-1]["id"])
    assert all(e["id"] > tl["events"][-1]["id"] for e in newer["events"])


def test_cli_logs_workers_and_cancel(deployment, client, finished_run, tiny_model):
    run_id = finished_run["run"]["id"]
    logs = cli(deployment, "logs", run_id)
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.count("rollout_done") == STEPS
    assert "cause=lost" in logs.stdout and "cause=notice" in logs.stdout
    workers = json.loads(cli(deployment, "workers", "--json").stdout)
    alive = {w["id"] for w in workers if w["alive"]}
    assert finished_run["lost"].name not in alive and finished_run["notice"].name not in alive
    assert len(alive) == 2
    table = cli(deployment, "workers")
    assert table.returncode == 0 and "preemptible" in table.stdout
    # a run cancelled from the CLI; without the token the CLI reports the 401 and changes nothing
    run2 = client.submit(small_spec(tiny_model, steps=50))
    refused = cli(deployment, "cancel", run2, token=None)
    assert refused.returncode == 1 and "401" in refused.stderr
    assert client.run(run2)["state"] in ("queued", "running")

    def holding() -> list[str]:  # the alive workers holding requests of run2
        return [
            w["id"] for w in client.workers() if w["alive"] and w["run_id"] == run2 and w["active"]
        ]

    wait_until(holding, "no worker held requests of the run", 120, 0.1)
    done = cli(deployment, "cancel", run2)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "cancelled"
    # cancelled mid-step, its workers drop what they held of it at once (their next beats)
    wait_until(lambda: not holding(), lambda: f"still held by {holding()}", 10, 0.1)
    wait_final(client, deployment, run2)
    again = cli(deployment, "cancel", run2)
    assert again.returncode == 1 and "409" in again.stderr


def test_a_paused_run_opens_no_step_until_resumed_and_loses_nothing(
    deployment, client, finished_run, tiny_model
):
    steps = 10  # long enough that the pause lands before its last step opens
    run_id = client.submit(small_spec(tiny_model, steps=steps, prompts_per_step=4))
    rdb = redis.Redis.from_url(deployment.redis_url)
    wait_until(lambda: client.run(run_id)["state"] == "running", "the run never started", 60, 0.02)
    assert client.order(run_id, "pause")["paused_at"] is not None
    held = wait_until(
        lambda: run_events(rdb, run_id, "held_by_pause"), "the pause held no step", 120, 0.1
    )
    step = held[0]["step"]
    # the steps before it finished and were trained (the API's read model says so once it
    # refreshed after the commit); it is not queued while paused
    assert step < steps
    wait_until(lambda: client.run(run_id)["step"] == step, "the API never said the step", 30, 0.05)
    assert not rdb.exists(keys.jobs_stream(run_id, step))
    listed = cli(deployment, "status")
    assert "(paused)" in listed.stdout, listed.stdout
    resumed = cli(deployment, "resume", run_id)
    assert resumed.returncode == 0 and json.loads(resumed.stdout)["paused_at"] is None
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded" and run["step"] == steps
    spec = RunSpec.model_validate(run["spec"])
    audit = audit_run(deployment.redis_url, run_id, spec)
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
    groups = read_groups(deployment, run_id)
    assert sorted((g.step, g.prompt_index) for g in groups) == [
        (s, p) for s in range(steps) for p in range(4)
    ]
    assert all(len(g.responses) == spec.training.group_size for g in groups)
    assert [e["kind"] for e in run_events(rdb, run_id) if e["kind"] in ("paused", "resumed")] == [
        "paused",
        "resumed",
    ]
    rdb.close()


def redis_snapshot(r: redis.Redis) -> dict[bytes, bytes]:
    """Every key's serialized value, less the heartbeats (they change every second)."""
    return {k: r.dump(k) for k in sorted(r.scan_iter(count=1000)) if not k.endswith(b":hb")}


def write_requests(deployment, run_id: str, worker_id: str, model_spec: dict):
    """One request with a valid body for every write route of the coordinator and weight store."""
    co, ws = deployment.coordinator_url, deployment.weightstore_url
    manifest = {"files": [{"name": "a.bin", "size": 1, "sha256": "0" * 64}]}
    worker = {"id": "intruder-1", "pool": "preemptible", "engine": "hf", "slots": 4}
    return [
        ("POST", f"{co}/v1/runs", {"json": model_spec}),
        ("POST", f"{co}/v1/runs/{run_id}/cancel", {}),
        ("POST", f"{co}/v1/runs/{run_id}/pause", {}),
        ("POST", f"{co}/v1/runs/{run_id}/resume", {}),
        ("POST", f"{co}/v1/workers", {"json": worker}),
        ("POST", f"{co}/v1/workers/{worker_id}/release", {"json": {"count": 1}}),
        ("DELETE", f"{co}/v1/workers/{worker_id}", {}),
        ("PUT", f"{ws}/v1/models/m-x/versions/0/files/a.bin", {"content": b"x"}),
        ("POST", f"{ws}/v1/models/m-x/versions/0/commit", {"json": manifest}),
        ("POST", f"{ws}/v1/content/have", {"json": {"sha256": ["0" * 64]}}),
    ]


def test_every_write_without_the_token_is_401_and_changes_nothing(
    deployment, client, finished_run, tiny_model
):
    r = redis.Redis.from_url(deployment.redis_url)
    assert r.get(keys.ACTIVE_RUN) is None
    run_id = finished_run["run"]["id"]
    worker_id = finished_run["lost"].name
    weights_root = deployment.work_dir / "weights"
    files_before = sorted(p.relative_to(weights_root) for p in weights_root.rglob("*"))
    before = redis_snapshot(r)
    spec = small_spec(tiny_model)
    requests = write_requests(deployment, run_id, worker_id, spec)
    # the OpenAPI specs list no write route that this test leaves out
    listed = set()
    for url in (deployment.coordinator_url, deployment.weightstore_url):
        for path, ops in httpx.get(f"{url}/openapi.json").json()["paths"].items():
            listed |= {(m.upper(), path) for m in ops if m in ("post", "put", "delete", "patch")}
    assert len(listed) == len(requests)
    for method, url, kwargs in requests:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            resp = httpx.request(method, url, headers=headers, timeout=10, **kwargs)
            assert resp.status_code == 401, (method, url, headers, resp.text)
            assert resp.headers["www-authenticate"] == "Bearer"
    assert redis_snapshot(r) == before
    assert sorted(p.relative_to(weights_root) for p in weights_root.rglob("*")) == files_before
    # the same bodies with the token are accepted: the 401s above were the token's doing
    created = httpx.post(
        f"{deployment.coordinator_url}/v1/runs",
        json=spec | {"steps": 1},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert created.status_code == 201
    wait_final(client, deployment, created.json()["id"])
    # reads stay open by default
    assert httpx.get(f"{deployment.coordinator_url}/v1/runs").status_code == 200
    r.close()


def test_reads_can_be_protected(deployment, tmp_path):
    port = procs.free_port()
    env = {
        "SPOTRL_REDIS_URL": deployment.redis_url,
        "SPOTRL_API_TOKEN": TOKEN,
        "SPOTRL_PROTECT_READS": "true",
        "SPOTRL_PORT": str(port),
    }
    proc = procs.start_service("coordinator-ro", "services.coordinator.main", env, tmp_path, port)
    try:
        procs.wait_healthy([proc])
        url = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for path in ("/v1/runs", "/v1/workers", "/metrics"):
            assert httpx.get(url + path).status_code == 401, path
            assert httpx.get(url + path, headers=auth).status_code == 200, path
        assert httpx.get(url + "/healthz").status_code == 200  # probes carry no token
        assert httpx.get(url + "/").status_code == 200  # the page asks for the token itself
    finally:
        proc.stop()

"""Our own services die too: the coordinator and the trainer killed with SIGKILL mid-step, the
weight store killed mid-upload, Redis restarted (with its append-only file) mid-run; each comes
back and the run goes on. Real processes; each run must end with every group of exactly n
responses, none twice, and the trainer's step count equal to the run's steps."""

import contextlib
import threading
import time

import httpx
import pytest

from services.cli.audit import audit_run
from services.contracts import keys
from services.contracts.runspec import RunSpec
from tests.harness.deploy import DeploymentConfig

from .conftest import deploy_config, small_spec, wait_final, wait_until

STEPS = 5
PROMPTS = 8
USERS_OF_REDIS = ("coordinator", "trainer")  # and every worker
OUTAGE = "redis unavailable"  # what services.infra.redis_streams logs while it retries


def outages(log_path) -> int:
    return log_path.read_text(errors="replace").count(OUTAGE)


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return deploy_config(
        tmp_path_factory.mktemp("crash"),
        preemptible=2,
        flush_tokens=1,
        # the trainer checkpoints every step (in the background) until a restart says otherwise
        extra_env={
            "SPOTRL_STEP_DELAY_MS": "120",
            "SPOTRL_OBSERVE_S": "0.5",
            "SPOTRL_CHECKPOINT_EVERY": "1",
        },
        redis_appendonly=True,
    )


def wait_mid_step(rdb, run_id: str, timeout_s: float = 120.0) -> int:
    """The step under way once some, not all, of its groups went to the trainer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = rdb.get(keys.run_version(run_id))
        if raw is not None:
            step = int(raw)
            published = rdb.scard(keys.step_published(run_id, step))
            if 0 < published < PROMPTS:
                return step
        time.sleep(0.02)
    raise TimeoutError("never caught the run mid-step")


def wait_past(rdb, run_id: str, step: int, timeout_s: float = 120.0) -> None:
    """Until the run's version is past `step` (the step was trained)."""
    wait_until(
        lambda: int(rdb.get(keys.run_version(run_id)) or 0) > step,
        f"the run never got past step {step}",
        timeout_s,
        0.05,
    )


def test_coordinator_killed_mid_step_resumes_the_step(deployment, client, rdb, tiny_model):
    body = small_spec(tiny_model, steps=STEPS, prompts_per_step=PROMPTS, max_new_tokens=8)
    run_id = client.submit(body)
    killed_at = []
    for _ in range(2):
        step = wait_mid_step(rdb, run_id)
        deployment.restart("coordinator", kill=True)
        killed_at.append(step)
        wait_past(rdb, run_id, step)  # the next kill: a later step
    check_run(deployment, client, rdb, run_id, body)
    log = (deployment.log_dir / "coordinator.log").read_text()
    assert log.count("resumed:") >= 2, killed_at


def check_run(deployment, client, rdb, run_id: str, body: dict) -> None:
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded", run["error"]
    audit = audit_run(deployment.redis_url, run_id, RunSpec.model_validate(body))
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
    assert audit["max_staleness"] == 0, audit  # every token by its step's version
    assert int(rdb.hget(keys.trainer_state(run_id), "steps_trained")) == body["steps"]
    assert run["groups_incomplete"] == 0


def test_trainer_killed_mid_step_resumes_from_its_checkpoint(deployment, client, rdb, tiny_model):
    body = small_spec(tiny_model, steps=STEPS, prompts_per_step=PROMPTS, max_new_tokens=8)
    run_id = client.submit(body)
    # (SIGKILL?, checkpoint every K steps in the process started after it)
    plan = [
        (True, "1000"),  # checkpoints every step so far: resumes from the announced version's
        (False, "1000"),  # none since: SIGTERM writes one at exit, and the next resumes from it
        (True, "1000"),  # behind: the announced version's weights from the store, Adam from then
    ]
    for kill, every in plan:
        step = wait_mid_step(rdb, run_id)  # groups of the step are reaching the trainer
        deployment.restart("trainer", kill=kill, settings={"SPOTRL_CHECKPOINT_EVERY": every})
        wait_past(rdb, run_id, step)
    check_run(deployment, client, rdb, run_id, body)
    trainer_log = deployment.log_dir / "trainer.log"
    # the SIGTERM, and the end of the run: the trainer writes that one after the run is over
    wait_until(lambda: trainer_log.read_text().count("at exit") >= 2, "no checkpoint at exit", 30)
    log = trainer_log.read_text()
    assert "from the weight store (checkpoint: step" in log
    assert log.count("resumed at") + log.count("resumed after") >= 2  # once from a checkpoint
    assert "from its checkpoint" in log
    # the reserved worker generated every step with that step's version, none skipped
    loaded = {int(v) for v in rdb.smembers(keys.worker_loads(run_id, "rollout-reserved-1"))}
    assert set(range(STEPS)) <= loaded <= set(range(STEPS + 1))


def test_redis_restarted_mid_run_with_its_append_only_file(deployment, client, rdb, tiny_model):
    body = small_spec(tiny_model, steps=STEPS, prompts_per_step=PROMPTS, max_new_tokens=8)
    run_id = client.submit(body)
    step = wait_mid_step(rdb, run_id)
    answers = []
    logs = {p.name: p.log_path for p in deployment.procs.values() if p.name in USERS_OF_REDIS}
    logs |= {p.name: p.log_path for p in deployment.workers()}
    seen = {name: outages(path) for name, path in logs.items()}

    def while_down() -> None:
        wait_until(  # every service sees it gone and backs off
            lambda: all(outages(path) > seen[name] for name, path in logs.items()),
            lambda: (
                "no outage logged by "
                + ", ".join(name for name, path in logs.items() if outages(path) <= seen[name])
            ),
            30,
            0.1,
        )
        url = f"{deployment.coordinator_url}/v1/runs/{run_id}"
        # reads come from the control plane's read model: it may answer once more from the
        # refresh just before Redis went, and must turn to 503 at its next one
        answers.append(
            wait_until(
                lambda: (a := httpx.get(url, timeout=10)).status_code == 503 and a,
                "reads still answered 200 with Redis down",
                10,
                0.05,
            )
        )

    deployment.restart_redis(while_down=while_down)
    assert answers[0].headers["retry-after"] == "2"
    rdb.connection_pool.disconnect()
    check_run(deployment, client, rdb, run_id, body)
    assert int(rdb.get(keys.run_version(run_id))) == STEPS > step
    for name, proc in deployment.procs.items():
        assert proc.alive(), f"{name} did not survive the Redis restart:\n{proc.log_tail()}"


def test_weight_store_killed_mid_upload(deployment, client, rdb, tiny_model):
    """A weight store killed while a version is being uploaded comes back with every committed
    version, without the cut-off upload, and the run (its trainer retrying) completes."""
    body = small_spec(tiny_model, steps=STEPS, prompts_per_step=PROMPTS, max_new_tokens=8)
    run_id = client.submit(body)
    step = wait_mid_step(rdb, run_id)
    store = deployment.weightstore_url
    before = httpx.get(f"{store}/v1/models/{run_id}/versions").json()["versions"]
    assert before, "version 0 at least is committed"
    uploading = threading.Event()

    def slow_body():
        uploading.set()
        for _ in range(200):
            yield b"x" * 4096
            time.sleep(0.05)

    def upload() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.put(f"{store}/v1/models/{run_id}/versions/999/files/cut.bin", content=slow_body())

    uploader = threading.Thread(target=upload)
    uploader.start()
    assert uploading.wait(10), "the upload never started"
    staging = deployment.work_dir / "weights" / run_id / "staging"
    wait_until(  # some of the bytes are in staging
        lambda: any(p.stat().st_size > 0 for p in staging.rglob("*.part")),
        "no partial upload in staging",
        8,
    )
    deployment.restart("weightstore", kill=True)
    uploader.join(30)
    after = httpx.get(f"{store}/v1/models/{run_id}/versions").json()["versions"]
    assert max(before) in after and 999 not in after  # (older ones may be pruned meanwhile)
    assert httpx.get(f"{store}/v1/models/{run_id}/versions/999/files/cut.bin").status_code == 404
    assert not any(staging.rglob("*.part")), "the cut-off upload was discarded"
    check_run(deployment, client, rdb, run_id, body)
    assert int(rdb.get(keys.run_version(run_id))) == STEPS > step
    versions = httpx.get(f"{store}/v1/models/{run_id}/versions").json()["versions"]
    assert versions[-1] == STEPS

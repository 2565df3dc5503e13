"""Asynchronous RL with bounded staleness (`max_staleness` k, issue 21), with real processes:
runs of k = 1 and k = 2 end exact (no group lost, none twice, every group of n responses), no
trained token comes from a version older than its step - k (the audit reads each token's
version), and some do come from an older one (the steps overlapped); with k = 2, a worker, the
coordinator and the trainer (which publishes a version while the next step's groups train)
SIGKILLed mid-run, each started again, leave the run exact."""

import pytest

from services.cli.audit import audit_run
from services.contracts import keys
from services.contracts.runspec import RunSpec
from tests.harness.deploy import DeploymentConfig

from .conftest import deploy_config, small_spec, wait_final, wait_until

pytestmark = pytest.mark.timeout(600)
PROMPTS = 6


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return deploy_config(
        tmp_path_factory.mktemp("async"),
        preemptible=2,
        flush_tokens=1,
        # decode steps slower than the trainer's step: the next steps overlap its training
        extra_env={"SPOTRL_STEP_DELAY_MS": "60", "SPOTRL_OBSERVE_S": "0.5"},
    )


def check_exact(deployment, client, rdb, run_id: str, body: dict) -> dict:
    run = wait_final(client, deployment, run_id, timeout_s=300)
    assert run["state"] == "succeeded", run["error"]
    audit = audit_run(deployment.redis_url, run_id, RunSpec.model_validate(body))
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
    assert int(rdb.hget(keys.trainer_state(run_id), "steps_trained")) == body["steps"]
    assert run["groups_incomplete"] == 0
    return audit


@pytest.mark.parametrize("k", [1, 2])
def test_bounded_staleness_runs_end_exact_within_their_bound(
    deployment, client, rdb, tiny_model, k
):
    body = small_spec(
        tiny_model, steps=5, prompts_per_step=PROMPTS, max_new_tokens=6, max_staleness=k
    )
    run_id = client.submit(body)
    audit = check_exact(deployment, client, rdb, run_id, body)
    assert 1 <= audit["max_staleness"] <= k, audit  # overlapped, never past the bound


def test_a_worker_the_coordinator_and_the_trainer_killed_with_two_steps_in_flight(
    deployment, client, rdb, tiny_model
):
    # steps enough that the run outlives the restarts: while the coordinator restarts, the
    # workers finish the (up to k + 1) steps in flight, which it then takes at once
    body = small_spec(
        tiny_model, steps=24, prompts_per_step=PROMPTS, max_new_tokens=8, max_staleness=2
    )
    run_id = client.submit(body)

    def in_flight() -> bool:  # a step past the committed version's is queued
        version = int(rdb.get(keys.run_version(run_id)) or -1)
        return version >= 1 and bool(rdb.exists(keys.jobs_stream(run_id, version + 1)))

    wait_until(in_flight, "no later step was queued beside the trained one", 120, 0.02)
    deployment.restart("rollout-preemptible-2", kill=True)
    wait_until(in_flight, "no later step in flight after the worker's restart", 120, 0.02)
    deployment.restart("coordinator", kill=True)
    wait_until(in_flight, "no later step in flight after the coordinator's restart", 120, 0.02)
    deployment.restart("trainer", kill=True)
    audit = check_exact(deployment, client, rdb, run_id, body)
    assert audit["max_staleness"] <= 2, audit
    log = (deployment.log_dir / "coordinator.log").read_text()
    assert "resumed" in log, log[-3000:]  # the restarted coordinator took up the steps in flight

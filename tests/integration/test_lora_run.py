"""A LoRA run end to end (issue 51), every service a real process: the trainer trains an adapter,
its versions after the base are adapters a fraction of the model's size, the workers' engines
apply them on the base they keep (no merge, no reload), nothing is lost or duplicated, and a
trainer SIGKILLed mid-run resumes its adapter (the versions after the restart are adapters of
the same base, the run succeeds)."""

import asyncio

import pytest

from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.contracts.runspec import RunSpec
from services.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from services.weights.transfer import WeightClient
from tests.harness.deploy import Deployment, DeploymentConfig
from tests.integration.conftest import small_spec, wait_final, wait_until

pytestmark = pytest.mark.slow
STEPS = 8


def test_a_lora_run_with_its_trainer_killed_mid_run(tmp_path, tiny_model):
    keep = {"SPOTRL_KEEP_VERSIONS": "3"}  # the base outlives the versions kept after it
    config = DeploymentConfig(tmp_path, reserved=1, preemptible=1, worker_slots=8, extra_env=keep)
    spec = small_spec(
        tiny_model, steps=STEPS, lora_r=4, lora_alpha=8, learning_rate=1e-3, group_size=4
    )
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        run_id = client.submit(spec)
        store = WeightClient(dep.weightstore_urls)
        wait_until(lambda: 3 in asyncio.run(store.versions(run_id)), "v3 never committed", 180)
        dep.procs["trainer"].kill()
        dep.restart("trainer", kill=True)
        run = wait_final(client, dep, run_id)
        assert run["state"] == "succeeded", run
        audit = audit_run(dep.redis_url, run_id, RunSpec.model_validate(spec))
        assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
        kept = asyncio.run(store.versions(run_id))
        manifests = {v: asyncio.run(store.manifest(run_id, v)) for v in kept}
        trainer_log = dep.procs["trainer"].log_tail(400)
        worker_logs = "\n".join(p.log_tail(400) for p in dep.workers())
    # the base stays while adapters of it do; the newest versions are the adapter alone
    assert kept[0] == 0 and kept[-1] == STEPS and len(kept) == 4, kept
    base_bytes = manifests[0].total_bytes()
    for version in kept[1:]:
        manifest = manifests[version]
        assert {f.name for f in manifest.files} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
        assert manifest.metadata.get("base_version") == 0
        assert manifest.total_bytes() < 0.25 * base_bytes
    assert "resumed" in trainer_log, trainer_log[-2000:]
    assert "an adapter the engine applies" in worker_logs, worker_logs[-2000:]

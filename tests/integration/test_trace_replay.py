"""A multi-step run while rollout workers follow a real spot trace, compressed in time: workers
join, get SIGTERM (notice) or SIGKILL in the middle of generation, and nothing is lost."""

from pathlib import Path

from services.cli.audit import audit_run
from services.cli.chaos import ChaosOptions, ChaosRunner
from services.cli.client import CoordinatorClient
from services.common.runspec import RunSpec
from tests.harness.deploy import Deployment, DeploymentConfig
from tests.integration.conftest import small_spec, wait_final

TRACE = Path(__file__).resolve().parents[1] / "data" / "aws-g4dn-xlarge-us-east-1c-2020-11-20.csv"


def test_trace_replay_completes_with_nothing_lost(tmp_path, tiny_model):
    # trace hours 6-7 at 100x: workers come and go every few seconds, about as fast as a new
    # worker process can start on a 2-core machine
    chaos = ChaosOptions(
        trace=TRACE,
        time_scale=100,
        max_workers=2,
        start_s=6 * 3600,
        hours=1,
        sigterm_fraction=0.5,
        grace_s=3,
        heartbeat_ttl_s=1.5,
    )
    targets = chaos.targets(2)
    assert len(targets) > 4  # the trace churns
    env = chaos.worker_env() | {"SPOTRL_STEP_DELAY_MS": "40"}
    with Deployment(
        DeploymentConfig(
            tmp_path,
            reserved=1,
            preemptible=targets[0][1],
            worker_slots=8,
            flush_tokens=2,
            extra_env=env,
        )
    ) as dep:
        runner = ChaosRunner(dep, targets, chaos.sigterm_fraction, seed=3)
        try:
            client = CoordinatorClient(dep.coordinator_url)
            spec = small_spec(
                tiny_model,
                steps=8,
                prompts_per_step=4,
                group_size=3,
                max_new_tokens=32,
                ignore_eos=True,
            )
            run_id = client.submit(spec)
            runner.start()
            run = wait_final(client, dep, run_id, timeout_s=300)
            runner.stop()
            assert run["state"] == "succeeded" and run["groups_incomplete"] == 0
            audit = audit_run(dep.redis_url, run_id, RunSpec.model_validate(spec))
            assert audit["lost"] == 0 and audit["duplicated"] == 0
            assert runner.counts["sigterm"] + runner.counts["sigkill"] > 0
            assert runner.counts["started"] > 0
            rows = client.metrics(run_id)
            moved = sum(sum(row["migrations"].values()) for row in rows)
            print(f"chaos {runner.counts}, migrations {moved}")
        finally:
            runner.stop()

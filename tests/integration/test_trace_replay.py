"""A multi-step run while rollout workers follow a real spot trace, compressed in time: workers
join, get SIGTERM (notice) or SIGKILL in the middle of generation, and nothing is lost."""

from pathlib import Path

from services.cli.audit import audit_run
from services.cli.chaos import ChaosOptions, ChaosRunner
from services.cli.client import CoordinatorClient
from services.contracts.runspec import RunSpec
from tests.harness.deploy import Deployment, DeploymentConfig
from tests.integration.conftest import small_spec, wait_final, wait_until

TRACE = Path(__file__).resolve().parents[1] / "data" / "aws-g4dn-xlarge-us-east-1c-2020-11-20.csv"


def replay_spec(tiny_model, steps: int, max_new_tokens: int) -> dict:
    return small_spec(
        tiny_model,
        steps=steps,
        prompts_per_step=4,
        group_size=3,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
    )


def finish_exact(client, dep, run_id: str, spec: dict, runner: ChaosRunner) -> None:
    """The run succeeds with every group complete, nothing lost and nothing twice."""
    run = wait_final(client, dep, run_id, timeout_s=300)
    runner.stop()
    assert run["state"] == "succeeded" and run["groups_incomplete"] == 0
    audit = audit_run(dep.redis_url, run_id, RunSpec.model_validate(spec))
    assert audit["lost"] == 0 and audit["duplicated"] == 0


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
            spec = replay_spec(tiny_model, steps=8, max_new_tokens=32)
            run_id = client.submit(spec)
            runner.start()
            finish_exact(client, dep, run_id, spec, runner)
            assert runner.counts["sigterm"] + runner.counts["sigkill"] > 0
            assert runner.counts["started"] > 0
            rows = client.metrics(run_id)
            moved = sum(sum(row["migrations"].values()) for row in rows)
            print(f"chaos {runner.counts}, migrations {moved}")
        finally:
            runner.stop()


def test_the_scaler_hands_back_workers_the_coordinator_does_not_want(tmp_path, tiny_model):
    """Three workers offered for the whole run. Once the run wants one (as if N_prem had said
    so) the scaler hands two back with SIGTERM, mid-step, and nothing is lost; wanting two
    again starts one."""
    chaos = ChaosOptions(trace=TRACE, grace_s=3, heartbeat_ttl_s=1.5)
    env = chaos.worker_env() | {"SPOTRL_STEP_DELAY_MS": "40"}
    wanted: list[int | None] = [None]
    with Deployment(
        DeploymentConfig(
            tmp_path, reserved=1, preemptible=3, worker_slots=8, flush_tokens=2, extra_env=env
        )
    ) as dep:
        runner = ChaosRunner(dep, [(0.0, 3)], 0.5, seed=3, wanted=lambda: wanted[0])
        try:
            client = CoordinatorClient(dep.coordinator_url)
            spec = replay_spec(tiny_model, steps=4, max_new_tokens=48)
            run_id = client.submit(spec)
            runner.start()
            wait_until(lambda: client.run(run_id)["step"] >= 1, "step 1", 120)
            wanted[0] = 1
            wait_until(lambda: len(runner.running()) == 1, "the surplus handed back", 30)
            assert runner.counts["scaled_in"] == 2 and runner.counts["sigkill"] == 0
            wanted[0] = 2
            wait_until(lambda: runner.counts["started"] == 1, "one more worker", 30)
            finish_exact(client, dep, run_id, spec, runner)
        finally:
            runner.stop()

"""The deployment's figures for a scaler, through a real coordinator's /metrics and GET /v1/fleet
(real Redis, real services): `spotrl_coordinator_runs_active` and
`spotrl_coordinator_preemptible_wanted` are 0 with no run, follow a run while it is active, are
restored from the run's record by a restarted coordinator, and go back to 0 when the run ends;
then `spotrl scale` takes "no run" as the pool's minimum (on `KubeApi`, the stand-in API server
of tests/integration/scale_engines.py).
"""

import os
import re
import subprocess
import sys

import httpx
import pytest

from services.cli.client import CoordinatorClient
from tests.harness.deploy import Deployment, DeploymentConfig
from tests.integration.conftest import small_spec, wait_until
from tests.integration.scale_engines import KubeApi, write_kubeconfig

KUBE_TOKEN = "kube-bearer-token"
CLUSTER_VARIABLES = ("KUBERNETES_SERVICE_HOST", "SPOTRL_API_TOKEN")  # none of this machine's


def gauges(dep: Deployment) -> tuple[float, float]:
    """(runs_active, preemptible_wanted) as the coordinator's /metrics shows them."""
    text = httpx.get(f"{dep.coordinator_url}/metrics", timeout=10).text

    def value(name: str) -> float:
        found = re.search(rf"^spotrl_coordinator_{name} (\S+)$", text, re.M)
        assert found is not None, f"no {name} on /metrics:\n{text}"
        return float(found[1])

    return value("runs_active"), value("preemptible_wanted")


def fleet(client: CoordinatorClient) -> dict:
    reply = client.http.get("/v1/fleet")
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    config = DeploymentConfig(
        tmp_path_factory.mktemp("fleet"),
        reserved=1,
        preemptible=1,
        worker_slots=8,
        flush_tokens=2,
        worker_env={"SPOTRL_STEP_DELAY_MS": "30"},  # slower steps: less CPU, same figures
    )
    with Deployment(config) as deployment:
        yield deployment


def test_the_fleet_gauges_follow_runs_and_restarts(dep, tiny_model, tmp_path):
    client = CoordinatorClient(dep.coordinator_url)
    try:
        assert gauges(dep) == (0, 0)  # no run yet
        assert fleet(client) == {
            "runs_active": 0,
            "preemptible_wanted": 0,
            "active_runs": [],
            "runs": [],
        }
        spec = small_spec(tiny_model, steps=100_000, prompts_per_step=4, group_size=2)
        run_id = client.submit(spec)
        wait_until(lambda: gauges(dep)[0] == 1, "runs_active never became 1", 60, 0.2)

        def figure() -> int | None:
            return client.run(run_id)["preemptible_wanted"]

        def figure_while_alive() -> int | None:
            dep.check_alive()
            return figure()

        wait_until(figure_while_alive, "the run never published preemptible_wanted", 240, 0.3)
        # no trainer: no step commits, so nothing but a restart's restore can set the gauge
        dep.procs["trainer"].stop()
        wanted = wait_until(
            lambda: (w := figure()) is not None and gauges(dep) == (1, w) and w,
            lambda: f"the gauges {gauges(dep)} never showed the run's figure {figure()}",
            60,
            0.2,
        )
        dep.restart("coordinator")
        wait_until(
            lambda: gauges(dep) == (1, wanted),
            lambda: f"a restarted coordinator shows {gauges(dep)}, not (1, {wanted})",
            60,
            0.2,
        )
        assert client.run(run_id)["state"] in ("running", "stalled")
        wait_until(lambda: fleet(client)["preemptible_wanted"] == wanted, "no fleet figure", 30)
        got = fleet(client)
        assert {k: v for k, v in got.items() if k != "runs"} == {
            "runs_active": 1,
            "preemptible_wanted": wanted,
            "active_runs": [run_id],
        }
        assert [(run["id"], run["share"]) for run in got["runs"]] == [(run_id, 1.0)], got
        client.cancel(run_id)
        wait_until(
            lambda: gauges(dep) == (0, 0),
            lambda: f"after the run ended the gauges show {gauges(dep)}",
            60,
            0.2,
        )
        wait_until(lambda: fleet(client)["runs_active"] == 0, "the fleet kept the run", 30)
        assert fleet(client)["preemptible_wanted"] == 0
        no_run_scales_to_the_minimum(dep, tmp_path, run_id)
    finally:
        client.close()


def no_run_scales_to_the_minimum(dep: Deployment, tmp_path, ended_run: str) -> None:
    """`spotrl scale` with no active run, and following a run that has ended: down to --min, a
    decision, not an error."""
    with KubeApi(KUBE_TOKEN) as api:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url, KUBE_TOKEN)
        target = ["--target", "k8s", "--namespace", "spot", "--deployment", "rollout"]
        args = [*target, "--kubeconfig", str(kubeconfig), "--min", "1", "--max", "5", "--once"]
        cmd = [sys.executable, "-m", "services.cli.main", "scale", "--url", dep.coordinator_url]
        env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
        for follow, shown in (([], "-"), (["--run", ended_run], ended_run)):
            api.replicas[("spot", "rollout")] = 7
            out = subprocess.run(
                [*cmd, *args, *follow], env=env, capture_output=True, text=True, timeout=120
            )
            assert out.returncode == 0, out.stderr
            assert f"run={shown} " in out.stderr, out.stderr
            assert "reason='down: no run'" in out.stderr, out.stderr
            assert api.replicas[("spot", "rollout")] == 1

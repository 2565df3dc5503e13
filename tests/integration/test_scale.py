"""`spotrl scale` end to end: a real coordinator in a real local deployment (reads protected by a
token) trains a run until it publishes `preemptible_wanted`; the command reads it and sets the
replica count of a Kubernetes Deployment (on `KubeApi`, a stand-in: no real API server can be
installed here) and of a service of a real one-node Swarm (`OneNodeSwarm`); see
tests/integration/scale_engines.py. The multi-host Swarm run (tests/swarm) scales for real too;
the Compose command lines are unit-tested (tests/unit/test_scaler.py).
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.cli import procs
from services.cli.client import CoordinatorClient
from services.cli.scale import Scaler
from services.cli.scale_settings import ScaleSettings
from services.cli.scale_targets import (
    KubernetesDeployment,
    ScaleTargetError,
    ScaleTargetMissing,
    SwarmService,
)
from tests.harness.deploy import Deployment, DeploymentConfig
from tests.integration.conftest import small_spec, wait_until
from tests.integration.scale_engines import (
    MERGE_TYPES,
    KubeApi,
    OneNodeSwarm,
    swarm_missing,
    write_kubeconfig,
)

TOKEN = "scale-test-token"
KUBE_TOKEN = "kube-bearer-token"


@pytest.fixture
def kube(tmp_path):
    with KubeApi(KUBE_TOKEN) as api:
        api.replicas[("spot", "rollout")] = 7
        yield api, write_kubeconfig(tmp_path / "kubeconfig", api.url, KUBE_TOKEN)


def test_the_kubernetes_target_reads_and_patches_the_scale_subresource(kube, tmp_path):
    api, kubeconfig = kube
    target = KubernetesDeployment("spot", "rollout", str(kubeconfig))
    assert target.replicas() == 7
    target.set_replicas(3)
    assert api.replicas[("spot", "rollout")] == 3 and target.replicas() == 3
    [(_, path, ctype)] = api.patches()
    assert path == "/apis/apps/v1/namespaces/spot/deployments/rollout/scale"
    assert ctype.split(";")[0] in MERGE_TYPES
    with pytest.raises(ScaleTargetMissing, match="k8s deployment spot/other not found"):
        KubernetesDeployment("spot", "other", str(kubeconfig)).replicas()
    wrong = write_kubeconfig(tmp_path / "wrong", api.url, "not-the-token")
    with pytest.raises(ScaleTargetError, match="401 Unauthorized"):
        KubernetesDeployment("spot", "rollout", str(wrong)).replicas()
    assert api.replicas[("spot", "rollout")] == 3


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model):
    """A deployment whose run has published preemptible_wanted and is still running."""
    config = DeploymentConfig(
        tmp_path_factory.mktemp("scale"),
        reserved=1,
        preemptible=1,
        worker_slots=8,
        flush_tokens=2,
        api_token=TOKEN,
        extra_env={"SPOTRL_PROTECT_READS": "true"},
        worker_env={"SPOTRL_STEP_DELAY_MS": "30"},  # slower steps: less CPU, same figures
    )
    with Deployment(config) as dep, CoordinatorClient(dep.coordinator_url, TOKEN) as client:
        # a run that outlasts the module: the scaler follows a live one
        spec = small_spec(tiny_model, steps=100_000, prompts_per_step=4, group_size=2)
        run_id = client.submit(spec)

        def figure():
            dep.check_alive()
            run = client.run(run_id)
            assert run["state"] in ("queued", "running"), run
            return run["preemptible_wanted"]

        wait_until(figure, "the run never published preemptible_wanted", 240, 0.3)
        yield dep, run_id
        assert client.run(run_id)["state"] == "running"
        client.cancel(run_id)


def scale_cli(dep, *args: str, token: str | None = TOKEN, env: dict[str, str] | None = None):
    env = {k: v for k, v in (env or os.environ).items() if k != "KUBERNETES_SERVICE_HOST"}
    env.pop("SPOTRL_API_TOKEN", None)
    if token:
        env["SPOTRL_API_TOKEN"] = token
    cmd = [sys.executable, "-m", "services.cli.main", "scale", "--url", dep.coordinator_url]
    return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=120)


def decision_lines(stderr: str, target: str = "k8s deployment") -> list[dict[str, str]]:
    """The decision log lines, as key=value pairs."""
    out = []
    for line in stderr.splitlines():
        if f" scale {target} " in line:
            out.append(dict(re.findall(r"(\w+)=('[^']*'|\S+)", line)))
    return out


def k8s_args(kubeconfig: Path, *more: str) -> list[str]:
    target = ["--target", "k8s", "--namespace", "spot", "--deployment", "rollout"]
    return [*target, "--kubeconfig", str(kubeconfig), *more]


def test_dry_run_reads_the_live_runs_figure_and_changes_nothing(live, kube):
    dep, run_id = live
    api, kubeconfig = kube
    out = scale_cli(dep, *k8s_args(kubeconfig, "--max", "5", "--once", "--dry-run"))
    assert out.returncode == 0, out.stderr
    [line] = decision_lines(out.stderr)
    assert line["run"] == run_id and int(line["wanted"]) >= 1, line
    assert line["current"] == "7" and line["target"] == str(min(5, int(line["wanted"])))
    assert line["reason"] == "'down'" and "dry_run" in out.stderr
    assert api.patches() == [] and api.replicas[("spot", "rollout")] == 7


def test_it_sets_the_deployment_to_the_figure_within_bounds(live, kube):
    dep, run_id = live
    api, kubeconfig = kube
    out = scale_cli(dep, *k8s_args(kubeconfig, "--run", run_id, "--max", "5", "--once"))
    assert out.returncode == 0, out.stderr
    [line] = decision_lines(out.stderr)
    wanted = int(line["wanted"])
    assert line["reason"] == "'down'" and int(line["target"]) == min(5, wanted)
    assert api.replicas[("spot", "rollout")] == min(5, wanted)
    # a lower bound above the figure holds the pool there
    api.replicas[("spot", "rollout")] = 0
    out = scale_cli(dep, *k8s_args(kubeconfig, "--min", "6", "--max", "9", "--once"))
    assert out.returncode == 0, out.stderr
    [line] = decision_lines(out.stderr)
    assert api.replicas[("spot", "rollout")] == max(6, min(9, int(line["wanted"]))) > 0


def test_it_runs_until_sigterm_and_serves_its_metrics(live, kube):
    dep, _ = live
    api, kubeconfig = kube
    port = procs.free_port()
    env = {**os.environ, "SPOTRL_API_TOKEN": TOKEN}
    args = k8s_args(kubeconfig, "--max", "5", "--interval", "0.3", "--cooldown", "3600")
    cmd = [sys.executable, "-m", "services.cli.main", "scale", "--url", dep.coordinator_url]
    proc = subprocess.Popen(
        [*cmd, *args, "--metrics-port", str(port)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def decisions() -> float:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            except httpx.HTTPError:
                return 0.0
            found = re.findall(r"^spotrl_scale_decisions_total\{[^}]*\} (\S+)$", text, re.M)
            return sum(float(v) for v in found) if sum(float(v) for v in found) >= 3 else 0.0

        wait_until(decisions, "no three decisions on /metrics", 60, 0.1)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'spotrl_scale_decisions_total{reason="down"} 1.0' in text, text
        target = int(float(re.search(r"^spotrl_scale_target_replicas (\S+)$", text, re.M)[1]))
        assert api.replicas[("spot", "rollout")] == target and 1 <= target <= 5
        assert len(api.patches()) == 1  # then steady, or in its hour of cooldown
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    lines = decision_lines(proc.stderr.read())
    assert len(lines) >= 3 and lines[0]["reason"] == "'down'"
    holds = ("'hold: steady'", "'hold: cooldown'", "'hold: at max'")  # the figure moves
    assert all(line["reason"] in holds for line in lines[1:]), lines


def test_clear_errors_with_their_exit_codes(live, kube):
    dep, run_id = live
    _, kubeconfig = kube
    cases = [  # args, token, exit code, the one line
        (["--min", "3", "--max", "2"], TOKEN, 2, "spotrl scale: --min 3 > --max 2"),
        (["--max", "2", "--run", "nope"], TOKEN, 3, "spotrl scale: run nope does not exist"),
        (["--max", "2"], None, 1, "spotrl scale: coordinator: GET /v1/fleet: 401"),
    ]
    for args, token, code, first in cases:
        out = scale_cli(dep, *k8s_args(kubeconfig, "--once", *args), token=token)
        assert out.returncode == code, (args, out.stderr)
        assert out.stderr.strip().splitlines()[-1].startswith(first), (args, out.stderr)
    missing = [a if a != "rollout" else "gone" for a in k8s_args(kubeconfig, "--max", "2")]
    out = scale_cli(dep, *missing, "--once", "--run", run_id)
    assert out.returncode == 4 and out.stderr.strip() == (
        "spotrl scale: k8s deployment spot/gone not found"
    ), out.stderr
    nobody = f"http://127.0.0.1:{procs.free_port()}"
    out = scale_cli(dep, *k8s_args(kubeconfig, "--max", "2", "--once", "--url", nobody))
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().startswith(f"spotrl scale: coordinator not reachable at {nobody}")
    assert len(out.stderr.strip().splitlines()) == 1


def test_after_its_first_decision_a_lost_coordinator_holds_the_pool(live, kube):
    """The first decision needs a figure (the CLI tests: no figure there is an error); once it
    has decided, a coordinator that cannot be read holds what runs."""
    dep, run_id = live
    api, kubeconfig = kube
    settings = ScaleSettings(
        url=dep.coordinator_url,
        run_id=run_id,
        target="k8s",
        namespace="spot",
        deployment="rollout",
        kubeconfig=str(kubeconfig),
        max_replicas=5,
        up_cooldown_s=0,
    )
    scaler = Scaler(
        settings, CoordinatorClient(dep.coordinator_url, TOKEN), settings.build_target()
    )
    try:
        first = scaler.tick()
        assert first.reason == "down" and api.replicas[("spot", "rollout")] == first.target
        scaler.client.close()
        scaler.client = CoordinatorClient(f"http://127.0.0.1:{procs.free_port()}", TOKEN)
        api.replicas[("spot", "rollout")] = 0  # below the figure: would go up, with no cooldown
        later = scaler.tick()
        assert (later.wanted, later.target, later.reason) == (None, 0, "hold: no figure")
        assert api.replicas[("spot", "rollout")] == 0 and scaler.counts["hold: no figure"] == 1
    finally:
        scaler.close()


@pytest.fixture(scope="module")
def swarm():
    why = swarm_missing()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Swarm target for real: {why}")
        pytest.skip(f"no one-node Swarm here: {why}")
    engine = OneNodeSwarm()
    try:
        engine.start()
        engine.create_service("rollout", 1)
        engine.create_service("agent", 0, mode="global")
        yield engine
    finally:
        engine.stop()
    assert engine.mounts() == [] and not engine.dir.exists()


def test_the_swarm_target_reads_and_sets_a_services_replicas(swarm, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", swarm.host)
    target = SwarmService("rollout")
    assert target.replicas() == swarm.spec_replicas("rollout") == 1
    target.set_replicas(3)
    assert target.replicas() == swarm.spec_replicas("rollout") == 3
    with pytest.raises(ScaleTargetMissing, match="no such service: gone"):
        SwarmService("gone").replicas()
    with pytest.raises(ScaleTargetError, match="swarm service agent is not replicated"):
        SwarmService("agent").replicas()


def test_the_cli_follows_the_figure_on_swarm(live, swarm):
    dep, run_id = live
    swarm.docker(
        "service", "update", "--replicas", "6", "--no-resolve-image", "--detach", "rollout"
    )
    args = ["--target", "swarm", "--service", "rollout", "--min", "1", "--max", "4"]
    args += ["--interval", "1", "--cooldown", "0", "--run", run_id, "--once"]
    out = scale_cli(dep, *args, env=swarm.env())
    assert out.returncode == 0, out.stderr
    [line] = decision_lines(out.stderr, "swarm service rollout")
    assert line["current"] == "6" and line["reason"] == "'down'"
    assert swarm.spec_replicas("rollout") == int(line["target"]) == min(4, int(line["wanted"]))

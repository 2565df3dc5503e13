"""Engines for `spotrl scale` to act on in tests, each the test's own and torn down after it.

`KubeApi`: no real Kubernetes API server can be installed on this machine (no kind node image,
k3s, kwok or envtest binaries offline), so this HTTP server on 127.0.0.1 stands in for one. It
speaks the API's documented JSON for `GET` and `PATCH
/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`: an autoscaling/v1 Scale object; a merge
or strategic-merge patch of spec.replicas (415 for another patch type, as the API server
answers); a v1 Status object with code 404 for a missing Deployment, 401 for a missing or wrong
bearer token. The official `kubernetes` client reaches it through a kubeconfig
(`write_kubeconfig`).

`OneNodeSwarm`: a real dockerd, a Swarm of one manager, in a network namespace of its own with
only a loopback interface (no route anywhere: no registry can be reached), its data and socket
in a temporary folder; one replicated service of an image imported from a one-file tarball. The
service's tasks cannot start (the image has no program): what `spotrl scale` reads and sets is
the service's replica count, which Swarm keeps whatever its tasks do.
"""

import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.compose.engine import mounts_under, stop_daemon, unmount
from tests.integration.conftest import wait_until

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
MERGE_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
SWARM_IMAGE = "spotrl-scale-probe:1"


class KubeApi:
    """Deployments' scale subresource, as the Kubernetes API serves it (see the module doc)."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.replicas: dict[tuple[str, str], int] = {}
        self.requests: list[tuple[str, str, str]] = []  # method, path, content type
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                api.handle(self, "GET")

            def do_PATCH(self) -> None:
                api.handle(self, "PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "KubeApi":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def patches(self) -> list[tuple[str, str, str]]:
        with self.lock:
            return [r for r in self.requests if r[0] == "PATCH"]

    @staticmethod
    def status(code: int, reason: str, message: str, details: dict | None = None) -> dict:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "details": details or {},
            "code": code,
        }

    def scale(self, ns: str, name: str) -> dict:
        n = self.replicas[(ns, name)]
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                "name": name,
                "namespace": ns,
                "uid": "0e2f5a8c-0000-4000-8000-000000000001",
                "resourceVersion": str(1000 + len(self.requests)),
                "creationTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": {"replicas": n},
            "status": {"replicas": n, "selector": f"app={name}"},
        }

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        ctype = h.headers.get("Content-Type", "")
        body = h.rfile.read(int(h.headers.get("Content-Length", 0) or 0))
        with self.lock:
            self.requests.append((method, h.path, ctype))
            code, doc = self.answer(h, method, ctype, body)
        data = json.dumps(doc).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def answer(self, h, method: str, ctype: str, body: bytes) -> tuple[int, dict]:
        if h.headers.get("Authorization") != f"Bearer {self.token}":
            return 401, self.status(401, "Unauthorized", "Unauthorized")
        match = SCALE_PATH.match(h.path.split("?")[0])
        if match is None:
            return 404, self.status(404, "NotFound", "the server could not find the resource")
        ns, name = match.groups()
        if (ns, name) not in self.replicas:
            details = {"name": name, "group": "apps", "kind": "deployments"}
            return 404, self.status(
                404, "NotFound", f'deployments.apps "{name}" not found', details
            )
        if method == "PATCH":
            if ctype.split(";")[0].strip() not in MERGE_TYPES:
                return 415, self.status(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown "
                    f"format - accepted media types include: {', '.join(MERGE_TYPES)}",
                )
            replicas = json.loads(body).get("spec", {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return 422, self.status(422, "Invalid", f"spec.replicas: Invalid value: {replicas}")
            self.replicas[(ns, name)] = replicas
        return 200, self.scale(ns, name)


def write_kubeconfig(path: Path, server: str, token: str) -> Path:
    """A kubeconfig (JSON is YAML) with one cluster, one user (a bearer token), one context."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "scaler", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "scaler"}}],
        "current-context": "test",
    }
    path.write_text(json.dumps(config))
    return path


def swarm_missing() -> str | None:
    """Why a one-node Swarm cannot start here (None: it can)."""
    missing = [t for t in ("dockerd", "docker", "unshare", "ip") if shutil.which(t) is None]
    if os.geteuid() != 0:
        missing.append("root (dockerd and unshare --net need it)")
    return "missing: " + ", ".join(missing) if missing else None


class OneNodeSwarm:
    """See the module doc. `env()` is the environment a docker command needs (DOCKER_HOST)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="spotrl-scale-"))  # short: a socket path
        self.host = f"unix://{self.dir / 'docker.sock'}"
        self.log_path = self.dir / "dockerd.log"
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host}

    def docker(self, *args: str, check: bool = True, stdin: bytes | None = None):
        return subprocess.run(
            ["docker", *args],
            env=self.env(),
            input=stdin,
            capture_output=True,
            timeout=120,
            check=check,
        )

    def start(self, timeout_s: float = 60.0) -> None:
        dockerd = [
            "dockerd",
            f"--data-root={self.dir / 'data'}",
            f"--exec-root={self.dir / 'exec'}",
            f"--pidfile={self.dir / 'dockerd.pid'}",
            f"--host={self.host}",
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-forward=false",
            "--ip-masq=false",
        ]
        script = 'ip link set lo up && exec "$@"'  # a namespace of its own, loopback only
        env = {**os.environ, "DOCKER_SERVICE_PREFER_OFFLINE_IMAGE": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--net", "--", "sh", "-c", script, "sh", *dockerd],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        wait_until(self._answering, lambda: f"dockerd answering: {self.log_tail()}", timeout_s)
        self.docker(
            "swarm", "init", "--advertise-addr", "127.0.0.1", "--listen-addr", "127.0.0.1:0"
        )
        self.docker("import", "-", SWARM_IMAGE, stdin=one_file_tarball())

    def _answering(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"dockerd exited {self.proc.returncode}: {self.log_tail()}")
        return self.docker("version", check=False).returncode == 0

    def create_service(self, name: str, replicas: int, mode: str = "replicated") -> None:
        args = ["service", "create", "--no-resolve-image", "--detach", "--name", name]
        args += ["--restart-condition", "none", "--mode", mode]
        if mode == "replicated":
            args += ["--replicas", str(replicas)]
        self.docker(*args, SWARM_IMAGE, "/none")

    def spec_replicas(self, name: str) -> int:
        out = self.docker(
            "service", "inspect", "--format", "{{.Spec.Mode.Replicated.Replicas}}", name
        )
        return int(out.stdout.strip())

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to dockerd (it stops its containerd), SIGKILL to what is left of its session,
        then its mounts and folder."""
        stop_daemon(self.proc, grace_s)
        unmount(self.mounts())
        shutil.rmtree(self.dir, ignore_errors=True)

    def mounts(self) -> list[str]:
        return mounts_under(self.dir)


def one_file_tarball() -> bytes:
    """A root filesystem of one small file: an image `docker import` makes with no registry."""
    data = b"spotrl scale test\n"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("probe.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()

"""A Docker Swarm of the test's own: each node a dockerd in its own network namespace (and UTS
namespace: its own host name), joined into one swarm over the fabric of tests/swarm/netns.py.

Each dockerd runs with no bridge, no iptables and no IP forwarding, prefers the images it holds
(DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1), and listens on a socket in a temporary folder. A node's
data root is kept between runs (~/.cache/spotrl/swarm/<node>, or SPOTRL_SWARM_DATA_ROOT) so the
images loaded once are there the next time; its swarm state, containers and volumes are not.
`stop()` undoes everything `start()` did, whatever failed; `leftovers()` lists what survived.
"""

import atexit
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from tests.compose.engine import EngineUnavailable, mounts_under, stop_daemon, unmount
from tests.integration.conftest import wait_until
from tests.swarm.netns import Fabric, inside, sweep_stale

CACHE = Path(os.environ.get("SPOTRL_SWARM_DATA_ROOT", Path.home() / ".cache" / "spotrl" / "swarm"))
# node name -> pool label; the first one is the manager
NODES = {"reserved": "reserved", "spot1": "spot", "spot2": "spot"}
CLIENT = "client"  # the namespace the test's own HTTP and Redis clients run in


def missing_tools() -> list[str]:
    """What this machine lacks to run the swarm (empty: nothing)."""
    out = [t for t in ("dockerd", "docker", "ip", "nsenter", "unshare") if not shutil.which(t)]
    if os.geteuid() != 0:
        out.append("root (network namespaces and dockerd need it)")
    return out


class Node:
    def __init__(self, name: str, pool: str, addr: str, netns: str, run_dir: Path) -> None:
        self.name, self.pool, self.addr, self.netns = name, pool, addr, netns
        self.data_root = CACHE / name
        self.run_dir = run_dir / name
        self.host = f"unix://{self.run_dir / 'd.sock'}"
        self.log_path = run_dir / f"{name}-dockerd.log"
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "0"}

    def docker(self, *args: str, check: bool = True, timeout_s: float = 120.0):
        out = subprocess.run(
            ["docker", *args], env=self.env(), capture_output=True, text=True, timeout=timeout_s
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"{self.name}: docker {' '.join(args)}: {out.stderr.strip()}")
        return out

    def launch(self) -> None:
        """dockerd in the node's namespace, named after the node; its swarm state fresh."""
        shutil.rmtree(self.data_root / "swarm", ignore_errors=True)  # a killed run's swarm
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True)
        args = [
            "nsenter", f"--net={self.netns}", "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec dockerd "$@"', self.name,
            f"--data-root={self.data_root}",
            f"--exec-root={self.run_dir / 'x'}",
            f"--pidfile={self.run_dir / 'd.pid'}",
            f"--host={self.host}",
            "--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false",
        ]  # fmt: skip
        env = {**os.environ, "DOCKER_SERVICE_PREFER_OFFLINE_IMAGE": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def answering(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise EngineUnavailable(f"{self.name}: dockerd exited: {self.log_tail()}")
        return self.docker("version", check=False, timeout_s=10).returncode == 0

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def clear(self) -> None:
        """Leave the swarm; remove every container and volume (the images stay)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.docker("swarm", "leave", "--force", check=False, timeout_s=60)
        ids = self.docker("ps", "-aq", check=False).stdout.split()
        if ids:
            self.docker("rm", "-f", *ids, check=False, timeout_s=120)
        volumes = self.docker("volume", "ls", "-q", check=False).stdout.split()
        if volumes:
            self.docker("volume", "rm", "-f", *volumes, check=False, timeout_s=60)

    def stop(self, grace_s: float = 30.0) -> None:
        stop_daemon(self.proc, grace_s)
        for pid in self.processes():  # shims that outlived their containerd
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        unmount(self.mounts())

    def processes(self) -> list[int]:
        """Processes started for this node: their command line names its run folder."""
        mark = str(self.run_dir).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if mark in (entry / "cmdline").read_bytes():
                        found.append(int(entry.name))
        return found

    def mounts(self) -> list[str]:
        """Mount points under the node's run folder or data root, deepest first."""
        return mounts_under(self.run_dir, self.data_root)


class Cluster:
    def __init__(self, nodes: dict[str, str] = NODES) -> None:
        self.fabric = Fabric([*nodes, CLIENT])
        self.run_dir = Path(tempfile.mkdtemp(prefix="spotrl-sw-"))  # short: socket paths
        self.nodes = {
            name: Node(name, pool, self.fabric.addr[name], self.fabric.path(name), self.run_dir)
            for name, pool in nodes.items()
        }
        self.manager = next(iter(self.nodes.values()))
        self._lock: int | None = None

    def client_netns(self):
        """`with cluster.client_netns():` the test's clients inside the cluster's network."""
        return inside(self.fabric.path(CLIENT))

    def start(self, timeout_s: float = 90.0) -> None:
        missing = missing_tools()
        if missing:
            raise EngineUnavailable("missing: " + ", ".join(missing))
        CACHE.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(CACHE / ".lock", os.O_CREAT | os.O_RDWR)
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # one swarm test at a time on these data roots
        sweep_stale()
        self.fabric.create()
        for node in self.nodes.values():
            node.launch()
        for node in self.nodes.values():
            wait_until(node.answering, f"{node.name}: dockerd answering", timeout_s, poll_s=0.2)
        for node in self.nodes.values():  # what a killed run left
            node.clear()
        self.form_swarm()

    def form_swarm(self) -> None:
        m = self.manager
        # heartbeats 20 s apart: a node is marked down only after a minute without one, so the
        # partition the scenario makes (~10 s) is spotrl's to handle, not Swarm's (which would
        # start the node's tasks elsewhere and stop them when it is back)
        m.docker("swarm", "init", "--advertise-addr", m.addr, "--listen-addr", f"{m.addr}:2377",
                 "--dispatcher-heartbeat", "20s")  # fmt: skip
        token = m.docker("swarm", "join-token", "-q", "worker").stdout.strip()
        for node in self.nodes.values():
            if node is not m:
                node.docker("swarm", "join", "--token", token, "--advertise-addr", node.addr,
                            "--listen-addr", f"{node.addr}:2377", f"{m.addr}:2377")  # fmt: skip
        wait_until(
            lambda: len(self.ready_nodes()) == len(self.nodes),
            lambda: f"every node ready: {self.ready_nodes()}",
            60,
            poll_s=0.5,
        )
        for node in self.nodes.values():
            m.docker("node", "update", "--label-add", f"pool={node.pool}", node.name)

    def ready_nodes(self) -> list[str]:
        listing = self.manager.docker(
            "node", "ls", "--format", "{{.Hostname}} {{.Status}} {{.Availability}}"
        )
        return [ln.split()[0] for ln in listing.stdout.splitlines() if " Ready " in f"{ln} "]

    def labels(self) -> dict[str, str]:
        return {
            n: self.manager.docker(
                "node", "inspect", "-f", '{{index .Spec.Labels "pool"}}', n
            ).stdout.strip()
            for n in self.nodes
        }

    def stop(self) -> None:
        """Everything start() made, gone: swarm, containers, volumes, daemons, mounts, netns."""
        try:
            for node in reversed(list(self.nodes.values())):
                with contextlib.suppress(Exception):
                    node.clear()
            for node in self.nodes.values():
                node.stop()
        finally:
            self.fabric.destroy()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None

    def leftovers(self) -> list[str]:
        out = self.fabric.leftovers()
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                out.append(f"{node.name}: dockerd {node.proc.pid}")
            out += [f"{node.name}: process {pid}" for pid in node.processes()]
            out += [f"{node.name}: mount {p}" for p in node.mounts()]
            for sub in ("containers", "volumes"):
                folder = node.data_root / sub
                if folder.is_dir():
                    left = [p.name for p in folder.iterdir() if p.is_dir()]
                    out += [f"{node.name}: {sub[:-1]} {x}" for x in left]
        return out


@contextlib.contextmanager
def running_cluster(nodes: dict[str, str] = NODES):
    """A started cluster for the block, stopped after it however the block ends: an exception,
    SIGTERM or SIGINT (turned into exceptions here), or the interpreter exiting."""
    cluster = Cluster(nodes)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def interrupted(signum, _frame):
        raise SystemExit(128 + signum)

    for s in previous:
        signal.signal(s, interrupted)
    atexit.register(cluster.stop)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        atexit.unregister(cluster.stop)
        for s, handler in previous.items():
            signal.signal(s, handler)

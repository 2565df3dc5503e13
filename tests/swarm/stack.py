"""The spotrl stack on the test's swarm: rendered from the compose files by tools/swarm_stack.py,
deployed with `docker stack deploy` (images as loaded, never resolved against a registry), its
containers found per node, its logs read, and removed with everything it made.

Its credentials are `spotrl secrets --tls`'s, as a user makes them: every hop over TLS (a
certificate for the reserved node's address and the node names), a Redis user per role (the
workers' minted at registration), a token per scope. The test's clients send the admin token,
read Redis as its read-only user, and check the services against the CA.
"""

import re
import time
from pathlib import Path

from services.cli.credentials import Credentials
from services.cli.secrets_command import write_secrets
from tests.integration.conftest import wait_until
from tests.swarm.cluster import Cluster, Node
from tools.swarm_stack import render

NAME = "spotrl"
RESERVED = ("redis", "coordinator", "weightstore", "trainer")
# a daemon that looks an image up in a registry says so in its log (a pull, a registry host, a
# DNS lookup): none of it may appear. Swarm's gossip (memberlist's "Push/Pull" with another
# node, which fails while the partitioned node is cut off) is not a pull of an image.
REGISTRY_LOOKUP = re.compile(r"(?<!push/)\bpull|registry|docker\.io|lookup \S+ on", re.I)
HEALTH = re.compile(r"\((healthy|unhealthy|health: starting)\)")
LOADED = re.compile(r"loaded \S+ v(\d+) \((\d+) bytes, (\d+) of them from peers\)")


class SwarmStack:
    def __init__(self, cluster: Cluster, work: Path, settings: dict[str, str]) -> None:
        self.cluster = cluster
        self.manager = cluster.manager
        self.reserved_addr = cluster.nodes["reserved"].addr
        self.models = work / "models"
        self.models.mkdir(parents=True, exist_ok=True)
        self.models.chmod(0o777)  # the services run as uid 10001
        self.stack_file = work / "stack.yml"
        secrets_dir = work / "secrets"
        credentials = Credentials.make()
        hosts = (self.reserved_addr, *cluster.nodes)  # the node names the workers advertise
        base_url = f"redis://{self.reserved_addr}:6379/0"
        write_secrets(secrets_dir, credentials, base_url, hosts)
        self.token = credentials.admin_token
        self.ca_file = secrets_dir / "tls" / "ca.crt"
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": str(work),
            "SPOTRL_SECRETS": str(secrets_dir),
            "SPOTRL_RESERVED_HOST": self.reserved_addr,
            "SPOTRL_MODELS": str(self.models),
            "SPOTRL_REDIS_IMAGE": "spotrl-base:bookworm",
            **settings,
        }
        rediss = f"rediss://{self.reserved_addr}:6379/0"
        self.redis_url = credentials.redis_url(rediss, "reader")  # audits and recovery: reads
        self.coordinator_url = f"https://{self.reserved_addr}:8100"

    def deploy(self) -> None:
        hosts = {n.name: n.addr for n in self.cluster.nodes.values()}
        self.stack_file.touch(mode=0o600)  # it holds every service's credentials
        self.stack_file.write_text(render(self.env, hosts))
        self.manager.docker(
            "stack", "deploy", "--detach=true", "--resolve-image", "never",
            "-c", str(self.stack_file), NAME,
        )  # fmt: skip

    def replicas(self) -> dict[str, str]:
        """Service -> "running/desired" as Swarm counts it."""
        out = self.manager.docker("service", "ls", "--format", "{{.Name}} {{.Replicas}}")
        return dict(line.split()[:2] for line in out.stdout.splitlines())

    def containers(self, node: Node, service: str, running: bool = True) -> list[str]:
        label = f"label=com.docker.swarm.service.name={NAME}_{service}"
        args = ["ps", "-q", "--no-trunc", "--filter", label, *([] if running else ["-a"])]
        return node.docker(*args).stdout.split()

    def health(self, node: Node) -> dict[str, str]:
        """Container name -> health (healthy, health: starting, unhealthy, none) on a node."""
        out = node.docker("ps", "--format", "{{.Names}}\t{{.Status}}").stdout
        return {
            name: m[1] if (m := HEALTH.search(status)) else "none"
            for name, status in (line.split("\t", 1) for line in out.splitlines())
        }

    def wait_healthy(self, timeout_s: float) -> None:
        def all_healthy() -> bool:
            counts = self.replicas()
            if len(counts) < len(RESERVED) + 1:
                return False
            if any(a != b for a, b in (c.split("/") for c in counts.values())):
                return False
            states = [s for n in self.cluster.nodes.values() for s in self.health(n).values()]
            return bool(states) and all(s == "healthy" for s in states)

        wait_until(
            all_healthy,
            lambda: (
                f"the stack healthy: {self.replicas()} "
                + str({n: self.health(node) for n, node in self.cluster.nodes.items()})
            ),
            timeout_s,
            poll_s=1.0,
        )

    def worker_of(self, node: Node, container: str) -> str | None:
        """The worker id a rollout container registered under (from its log)."""
        out = node.docker("logs", container, check=False).stderr
        m = re.search(r"registered (\S+) \(", out)
        return m[1] if m else None

    def service_logs(self, service: str) -> list[str]:
        """The service's log lines, each `task@node | line`, from every task Swarm keeps."""
        out = self.manager.docker(
            "service", "logs", "--no-trunc", f"{NAME}_{service}", check=False, timeout_s=60
        )
        return (out.stdout + out.stderr).splitlines()

    def peer_loads(self) -> list[tuple[str, int, int, int]]:
        """(node, version, bytes, bytes from peers) of every weight load of the workers."""
        loads = []
        for line in self.service_logs("rollout"):
            m = LOADED.search(line)
            node = re.search(r"@(\S+)\s*\|", line)
            if m and node:
                loads.append((node[1], int(m[1]), int(m[2]), int(m[3])))
        return loads

    def registry_lookups(self) -> list[str]:
        found = []
        for node in self.cluster.nodes.values():
            text = node.log_path.read_text(errors="replace")
            found += [
                f"{node.name}: {ln}" for ln in text.splitlines() if REGISTRY_LOOKUP.search(ln)
            ]
        return found

    def remove(self, timeout_s: float = 90.0) -> list[str]:
        """`docker stack rm`, then wait until no node runs a container of it; what stayed."""
        self.manager.docker("stack", "rm", NAME, check=False)

        def left() -> list[str]:
            label = f"label=com.docker.stack.namespace={NAME}"
            return [
                f"{n.name}: {c}"
                for n in self.cluster.nodes.values()
                for c in n.docker("ps", "-aq", "--filter", label, check=False).stdout.split()
            ]

        deadline = time.monotonic() + timeout_s
        while (remaining := left()) and time.monotonic() < deadline:
            time.sleep(1.0)
        return remaining

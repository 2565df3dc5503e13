"""The test's own network: one namespace per Swarm node and one for the test's clients, each
joined by a veth pair to a bridge that lives in a hub namespace of its own.

Addresses are in a test-only subnet (10.254.0.0/24) assigned inside the namespaces; no namespace
has a route out of that subnet, and the host's own interfaces are never touched (both ends of
every veth are created directly inside the namespaces). Every name carries the creating
process's id, so namespaces left by a process that died without cleaning up are found and
removed by the next run (`sweep_stale`).

`inside(path)` moves the calling thread into a namespace for a `with` block (setns(2)): the
sockets it opens there (HTTP, Redis) live in that namespace, and so do the processes it starts.
"""

import contextlib
import ctypes
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

PREFIX = "spotrl-sw"
SUBNET = "10.254.0"  # a /24 that only these namespaces use
NETNS_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000


def ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def our_namespaces(tag: str = PREFIX) -> list[str]:
    """Namespaces whose names start with `tag` (all of this test's, by default)."""
    listing = ip("netns", "list")
    return [line.split()[0] for line in listing.splitlines() if line.startswith(tag)]


def sweep_stale() -> list[str]:
    """Remove the namespaces of earlier runs whose process is gone; return their names."""
    removed = []
    for name in our_namespaces():
        m = re.match(rf"{PREFIX}(\d+)-", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            removed.append(name)
    return removed


class Fabric:
    """Namespaces for `members` (each with one address) around a bridge in a hub namespace."""

    def __init__(self, members: list[str]) -> None:
        self.tag = f"{PREFIX}{os.getpid()}-"
        self.hub = f"{self.tag}hub"
        self.netns = {m: f"{self.tag}{m}" for m in members}
        self.addr = {m: f"{SUBNET}.{10 + i}" for i, m in enumerate(members)}

    def path(self, member: str) -> str:
        return str(NETNS_DIR / self.netns[member])

    def create(self) -> None:
        ip("netns", "add", self.hub)
        ip("-n", self.hub, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")
        for member, ns in self.netns.items():
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            port = f"v-{member}"[:15]
            ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0",
               "netns", ns)  # fmt: skip
            ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.addr[member]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def routes(self, member: str) -> list[str]:
        """The member's IPv4 routes: only the subnet's own (no way out)."""
        return ip("-n", self.netns[member], "-4", "route", "show").splitlines()

    def cut(self, member: str) -> None:
        """Partition `member`: its bridge port down, so nothing reaches it or leaves it (its
        processes keep running, as a spot VM cut off from the network does)."""
        ip("-n", self.hub, "link", "set", f"v-{member}"[:15], "down")

    def mend(self, member: str) -> None:
        """`member` back on the network."""
        ip("-n", self.hub, "link", "set", f"v-{member}"[:15], "up")

    def destroy(self) -> None:
        """Delete every namespace of this fabric (their veths and the bridge go with them)."""
        for ns in [*self.netns.values(), self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def leftovers(self) -> list[str]:
        out = [f"netns {n}" for n in our_namespaces(self.tag)]
        host_links = ip("-o", "link", "show")
        for member in self.netns:
            if re.search(rf"^\d+: v-{re.escape(member)}[@:]", host_links, re.M):
                out.append(f"veth v-{member} in the host namespace")
        return out


@contextlib.contextmanager
def inside(netns_path: str) -> Iterator[None]:
    """The calling thread in the network namespace at `netns_path` for the block."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(netns_path, os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns_path}")
        yield
    finally:
        if libc.setns(home, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back into the test's own namespace")
        os.close(target)
        os.close(home)

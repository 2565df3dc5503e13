"""Redis with a replica and a Sentinel on 127.0.0.1, for the failover tests: a primary (the
append-only file on, as Compose runs it), a replica of it, and one Sentinel (quorum 1) that
promotes the replica once the primary has not answered for `down_after_ms`. Services reach it
through `url` (redis+sentinel://), the tests through `open()`.

Before the kill, the replica can be moved onto a relay (`ReplicationLink`) that the test then
holds: what the primary sends meanwhile never reaches the replica, as when a primary's host dies
with writes in flight. On one machine a SIGKILL alone loses nothing: the primary hands each
write to the replica's socket in the event-loop turn that acknowledges it. (The relay is set up
only then: Sentinel points a replica that replicates from another address than the primary's
back at the primary within seconds.)
"""

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from services.cli import procs
from services.cli.redis_client import open_redis
from services.infra.redis_users import credential_url

SERVICE = "spotrl"  # Sentinel's name of the primary


class ReplicationLink:
    """A TCP relay from the replica to the primary. `hold()`: from now on, what the primary
    sends is thrown away (the replica's link stays up, silent); `cut()` closes every
    connection."""

    def __init__(self, primary_port: int) -> None:
        self.primary_port = primary_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held = threading.Event()
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                replica, _ = self.listener.accept()
                primary = socket.create_connection(("127.0.0.1", self.primary_port))
            except OSError:
                return
            with self.lock:
                self.sockets += [replica, primary]
            for src, dst, holds in ((primary, replica, True), (replica, primary, False)):
                threading.Thread(target=self._pump, args=(src, dst, holds), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, holds: bool) -> None:
        try:
            while data := src.recv(65536):
                if not (holds and self.held.is_set()):
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def hold(self) -> None:
        self.held.set()

    def cut(self) -> None:
        self.listener.close()
        with self.lock:
            for s in self.sockets:
                with contextlib.suppress(OSError):
                    s.close()


@dataclass(frozen=True)
class NodeUsers:
    """Redis users on: the ACL file both nodes load, what the replica and Sentinel log in to
    the nodes as (the roles' passwords), and the test's own user (`node_url`, `open`)."""

    aclfile: Path
    replica_password: str
    sentinel_password: str
    admin: tuple[str, str]


class SentinelRedis:
    def __init__(
        self,
        folder: Path,
        down_after_ms: int = 700,
        failover_timeout_ms: int = 3000,
        users: "NodeUsers | None" = None,
    ):
        self.folder = Path(folder)
        self.users = users
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.procs: dict[str, procs.Proc] = {}
        self.ports: dict[str, int] = {}
        self.link: ReplicationLink | None = None  # the relay the replica was moved onto

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.ports['sentinel']}/{SERVICE}/0"

    def node_url(self, name: str) -> str:
        """A node itself, as a plain redis:// URL (what Sentinel's failover does not move), as
        the test's own user where there are users."""
        login = f"{self.users.admin[0]}:{self.users.admin[1]}@" if self.users else ""
        return f"redis://{login}127.0.0.1:{self.ports[name]}/0"

    def open(self) -> redis.Redis:
        """A client of whichever node is the primary now (as the test's own user)."""
        if self.users is None:
            return open_redis(self.url)
        return open_redis(credential_url(self.url, *self.users.admin))

    def _node_args(self) -> tuple[str, ...]:
        """Each node's users, and what it logs in to a primary as (once it is a replica)."""
        if self.users is None:
            return ()
        return (
            "--aclfile", str(self.users.aclfile.resolve()),
            "--masteruser", "spotrl-replica", "--masterauth", self.users.replica_password,
        )  # fmt: skip

    def start(self) -> "SentinelRedis":
        logs = self.folder / "logs"
        for name in ("primary", "replica"):
            extra = self._node_args()
            if name == "replica":
                extra += ("--replicaof", "127.0.0.1", str(self.ports["primary"]))
            proc, url = procs.start_redis(
                logs, self.folder / name, appendonly=True, maxmemory_mb=1024, name=f"redis-{name}",
                extra_args=extra,
            )  # fmt: skip
            self.procs[name] = proc
            self.ports[name] = int(url.rsplit(":", 1)[1].split("/")[0])
        self._wait(self._replicating, "the replica never caught up")
        self._start_sentinel(logs)
        self._wait(self._sentinel_ready, "the sentinel never saw the primary and its replica")
        return self

    def _start_sentinel(self, logs: Path) -> None:
        port = procs.free_port()
        conf = self.folder / "sentinel.conf"  # Sentinel rewrites it: its own copy
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.folder.resolve()}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.ports['primary']} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        if self.users is not None:
            with conf.open("a") as f:
                f.write(f"sentinel auth-user {SERVICE} spotrl-sentinel\n")
                f.write(f"sentinel auth-pass {SERVICE} {self.users.sentinel_password}\n")
        binary = procs.redis_server_binary()
        self.procs["sentinel"] = procs.start(
            "redis-sentinel", [binary, str(conf), "--sentinel"], {}, logs
        )
        self.ports["sentinel"] = port

    def _replicating(self, port: int | None = None) -> bool:
        """The replica's link is up (to `port`, where given)."""
        with redis.Redis.from_url(self.node_url("replica")) as r:
            info = r.info("replication")
        to = port is None or int(info.get("master_port", 0)) == port
        return to and info.get("master_link_status") == "up"

    def _sentinel_ready(self) -> bool:
        try:
            with redis.Redis(port=self.ports["sentinel"], socket_timeout=1) as s:
                master = s.sentinel_master(SERVICE)
                replicas = s.sentinel_slaves(SERVICE)
        except (redis.ConnectionError, redis.ResponseError):
            return False
        return bool(master.get("is_master")) and any(not r["is_sdown"] for r in replicas)

    def primary_port(self) -> int | None:
        """The port of the node Sentinel names the primary now, as clients ask (SENTINEL
        MASTERS: GET-MASTER-ADDR-BY-NAME names the promoted replica a moment earlier)."""
        with redis.Redis(port=self.ports["sentinel"], socket_timeout=1) as s:
            state = s.sentinel_master(SERVICE)
        if not state.get("is_master") or state.get("is_sdown") or state.get("is_odown"):
            return None
        return int(state["port"])

    def kill_primary(self, hold_s: float = 0.0) -> int:
        """SIGKILL the primary, after holding the replication link for `hold_s` (what the
        primary acknowledged meanwhile is lost); Sentinel promotes the replica after
        `down_after_ms`. The primary's replication offset just before: what it had written."""
        if hold_s > 0:
            self.link = ReplicationLink(self.ports["primary"])
            with redis.Redis.from_url(self.node_url("replica")) as r:
                r.replicaof("127.0.0.1", self.link.port)  # a partial resync: same history
            self._wait(lambda: self._replicating(self.link.port), "no resync through the relay")
            self.link.hold()
            time.sleep(hold_s)
        with redis.Redis.from_url(self.node_url("primary")) as r:
            offset = int(r.info("replication")["master_repl_offset"])
        self.procs["primary"].kill()
        if self.link is not None:
            self.link.cut()
        return offset

    def promoted_at(self) -> int:
        """The replication offset the promoted replica had when it took over."""
        with redis.Redis.from_url(self.node_url("replica")) as r:
            return int(r.info("replication")["second_repl_offset"]) - 1

    def wait_promoted(self, timeout_s: float = 30.0) -> float:
        """Until Sentinel names the replica the primary and it takes writes; the seconds it took."""
        t0 = time.monotonic()

        def promoted() -> bool:
            if self.primary_port() != self.ports["replica"]:
                return False
            with redis.Redis.from_url(self.node_url("replica")) as r:
                return r.info("replication").get("role") == "master"

        self._wait(promoted, "sentinel never promoted the replica", timeout_s)
        return time.monotonic() - t0

    def _wait(self, check, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
        raise TimeoutError(what)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop(5)
        if self.link is not None:
            self.link.cut()

    def __enter__(self) -> "SentinelRedis":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

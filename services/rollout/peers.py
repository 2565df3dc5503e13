"""A rollout worker's part in peer-to-peer weight fan-out: it serves the versions it holds, and
while it pulls a version the blocks it has verified so far, to the other workers, and it pulls
from them (services.weights.block_fetch). The weight store stays the source of truth and the
only writer: a peer only relays bytes that the store's manifest verifies.

- `PeerShelf`: what this worker serves: per version, its folder and which blocks are verified
  (all, once the pull is whole). The block server's thread reads it: a lock guards it.
- `RedisSwarm`: one pull's `Swarm`: who else holds which blocks, from the run's holders hash
  (keys.weight_holders), and this worker's own entry there, updated as blocks verify.
- `Peers`: the shelf, its block server, and a swarm per pull.
"""

import json
import logging
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.contracts import keys
from services.infra import tls, tls_reload
from services.infra.redis_streams import text
from services.infra.scopes import Tokens
from services.infra.settings import is_loopback
from services.rollout.settings import RolloutSettings
from services.weights.block_server import BlockServer
from services.weights.block_sources import ALL, Block, Holding

log = logging.getLogger(__name__)
HOLDERS_TTL_S = 3600  # a version's holders hash outlives its last change by this much


@dataclass
class Held:
    folder: Path
    blocks: dict[tuple[str, int], Block]  # (file, first byte) -> block
    files: frozenset[str]
    verified: set[int]
    whole: bool = False


class PeerShelf:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int], Held] = {}

    def begin(self, model: str, version: int, folder: Path, blocks: list[Block]) -> None:
        by_start = {(b.name, b.start): b for b in blocks}
        with self._lock:
            self._held[model, version] = Held(folder, by_start, frozenset(), set())

    def verified(self, model: str, version: int, blocks: list[Block]) -> None:
        with self._lock:
            held = self._held.get((model, version))
            if held is not None:
                held.verified.update(b.index for b in blocks)

    def complete(self, model: str, version: int, folder: Path, files: list[str]) -> None:
        with self._lock:
            self._held[model, version] = Held(folder, {}, frozenset(files), set(), whole=True)

    def held(self) -> list[tuple[str, int]]:
        """The (run, version) pairs served now."""
        with self._lock:
            return list(self._held)

    def drop(self, model: str, version: int) -> None:
        with self._lock:
            self._held.pop((model, version), None)

    def resolve(
        self, model: str, version: int, name: str, start: int, last: int | None
    ) -> Path | None:
        """The file to answer with: any range of a version held whole; of a version being
        pulled, exactly one verified block."""
        with self._lock:
            held = self._held.get((model, version))
            if held is None:
                return None
            if held.whole:
                return held.folder / name if name in held.files else None
            block = held.blocks.get((name, start))
            if block is None or block.index not in held.verified:
                return None
            if last is None or last > block.end:
                return None
            return held.folder / name


class RedisSwarm:
    """The peers of one pull of `version` of run `run_id`, through Redis."""

    def __init__(
        self,
        r: aioredis.Redis,
        shelf: PeerShelf,
        run_id: str,
        version: int,
        worker_id: str,
        url: str,
    ) -> None:
        self.r, self.shelf, self.run_id, self.version = r, shelf, run_id, version
        self.worker_id, self.url = worker_id, url
        self.key = keys.weight_holders(run_id, version)
        self.have = 0  # bit i: block i verified here
        self._decoded: dict[bytes, Holding] = {}  # a record as read -> its blocks

    async def holders(self) -> dict[str, Holding]:
        raw = await self.r.hgetall(self.key)
        found: dict[str, Holding] = {}
        for worker, record in raw.items():
            if text(worker) == self.worker_id:
                continue
            parsed = self._parse(record if isinstance(record, bytes) else record.encode())
            if parsed is not None:
                found[parsed[0]] = parsed[1]
        return found

    def _parse(self, record: bytes) -> tuple[str, Holding] | None:
        try:
            fields = json.loads(record)
            url, blocks = str(fields["url"]), fields["blocks"]
            if blocks == "all":
                return url, ALL
            if record not in self._decoded:
                bits = int(blocks, 16)
                self._decoded[record] = frozenset(
                    i for i, bit in enumerate(reversed(bin(bits)[2:])) if bit == "1"
                )
            return url, self._decoded[record]
        except (ValueError, KeyError, TypeError):
            return None  # an entry this worker cannot read is one it does not use

    async def begin(self, folder: Path, blocks: list[Block]) -> None:
        self.shelf.begin(self.run_id, self.version, folder, blocks)

    async def verified(self, blocks: list[Block]) -> None:
        if not blocks:
            return
        self.shelf.verified(self.run_id, self.version, blocks)
        for block in blocks:
            self.have |= 1 << block.index
        await self._announce(format(self.have, "x"))

    async def complete(self, folder: Path) -> None:
        files = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
        self.shelf.complete(self.run_id, self.version, folder, files)
        await self._announce("all")

    async def abandon(self) -> None:
        self.shelf.drop(self.run_id, self.version)
        try:
            await self.r.hdel(self.key, self.worker_id)
        except RedisError as exc:
            log.warning("could not withdraw %s v%d from the holders: %s", *self._it(), exc)

    async def _announce(self, blocks: str) -> None:
        """Best effort: peers that do not learn of a block take it from the store."""
        record = json.dumps({"url": self.url, "blocks": blocks})
        try:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.hset(self.key, self.worker_id, record)
                pipe.expire(self.key, HOLDERS_TTL_S)
                await pipe.execute()
        except RedisError as exc:
            log.warning("could not announce blocks of %s v%d: %s", *self._it(), exc)

    def _it(self) -> tuple[str, int]:
        return self.run_id, self.version


def advertised_host(s: RolloutSettings) -> str:
    if s.peer_host:
        return s.peer_host
    if s.host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return s.host


class Peers:
    """This worker among its peers: the versions it serves and a swarm for each pull."""

    def __init__(self, s: RolloutSettings) -> None:
        self.s = s
        self.shelf = PeerShelf()
        egress = s.peer_egress_mbps * 1e6 / 8 if s.peer_egress_mbps else None
        # a peer serves workers (and readers): it checks their tokens wherever it is reachable
        tokens = (
            Tokens.of(s.api_token, s.accept_tokens)
            if s.protect_reads or not is_loopback(s.host)
            else None
        )
        self.server = BlockServer(
            self.shelf.resolve,
            s.host,
            s.peer_port,
            tokens,
            s.peer_max_serving,
            egress,
            "peer",
            tls_reload.server_context(s),
            scopes=frozenset({"worker", "read"}),
            limits=s.connection_limits(),
        )
        self.url = ""

    def start(self) -> None:
        if not self.url:
            port = self.server.start()
            self.url = f"{tls.scheme(self.s)}://{advertised_host(self.s)}:{port}"

    def swarm(self, r: aioredis.Redis, run_id: str, version: int) -> RedisSwarm:
        self.start()
        return RedisSwarm(r, self.shelf, run_id, version, self.s.worker_id, self.url)

    async def forget(self, r: aioredis.Redis, run_id: str, version: int) -> None:
        """Serve `version` no more (its folder is about to go)."""
        await self.swarm(r, run_id, version).abandon()

    async def withdraw(self, r: aioredis.Redis) -> None:
        """Leaving: take this worker out of the holders of every version it serves, so that no
        puller tries it first (one that does falls back at the refused connection anyway)."""
        for run_id, version in self.shelf.held():
            await self.forget(r, run_id, version)

    def stop(self) -> None:
        if self.url:
            self.server.stop()

"""Redis behind Sentinel: the clients that follow the primary Sentinel points at, the fence that
keeps a loop holding state read from one primary from writing it to the next, and the wait for
a replica after a write that must survive a failover.

A failover (Sentinel promotes a replica once the primary is lost) looks like an outage to every
service: commands fail until the promotion, then go to the new primary. Replication is
asynchronous, so the new primary may lack the last writes the old one acknowledged: the new
primary's data is the old one's as it was a moment earlier. A loop that keeps in memory state
derived from Redis (a coordinator's step tables, a trainer's step) must then start again from
what the new primary holds, as after a crash of its own. `fenced(r)` marks the current task,
and the tasks it starts, as such a loop: once the client has connected to another primary than
the one the fence was set under, every command of the loop raises `RedisFailedOver` (before it
is sent). Loops that keep nothing of Redis's (heartbeats, the API's reads) go on as after any
outage.

It elects, promotes and watches nothing itself: Sentinel does. With a plain redis:// URL
nothing here applies (a fence is a no-op, `primary_of` is None).

Its URL, redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/DB], is parsed by
`sentinel_url`.
"""

import contextvars
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.sentinel import Sentinel as SyncSentinel

from services.infra.sentinel_url import SentinelUrl

log = logging.getLogger(__name__)
SENTINEL_TIMEOUT_S = 1.0  # a Sentinel that does not answer within this is skipped
WAIT_SHORT = Counter(
    "spotrl_redis_wait_short_total",
    "Writes that fewer replicas than asked acknowledged within the wait (WAIT)",
)


class RedisFailedOver(Exception):
    """The Redis primary changed under a fenced loop: Sentinel promoted a replica, which may
    lack the last writes the old primary acknowledged. What the loop holds in memory may be
    ahead of Redis: it starts again from what the new primary holds. Not a ConnectionError:
    retrying the command in place would write that state to the new primary."""


def _node_args(url: SentinelUrl, ca_file: Path | str | None) -> dict[str, Any]:
    """What every connection to a Redis node (or a Sentinel) of `url` is opened with."""
    args: dict[str, Any] = {}
    if url.tls:
        args["ssl"] = True
        if ca_file:
            args["ssl_ca_certs"] = str(ca_file)
    return args


def _sentinel_args(url: SentinelUrl, ca_file: Path | str | None) -> dict[str, Any]:
    timeouts = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    return timeouts | _node_args(url, ca_file)


def _credentials(url: SentinelUrl) -> dict[str, Any]:
    return {"username": url.username, "password": url.password}


@dataclass(frozen=True)
class Fence:
    pool: "FencedPool"
    epoch: int  # the pool's primary when the fence was set


_FENCE: contextvars.ContextVar[Fence | None] = contextvars.ContextVar("redis_fence", default=None)


class FencedPool(SentinelConnectionPool):
    """A pool of connections to the primary Sentinel points at, which counts the primaries it
    has seen (`epoch`) and refuses every command of a loop fenced under an earlier one."""

    def __init__(self, service_name, sentinel_manager, **kwargs) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)
        self.epoch = 0  # primaries seen after the first

    async def get_master_address(self):
        address = await self.sentinel_manager.discover_master(self.service_name)
        if address != self.master_address:
            if self.master_address is not None:
                self.epoch += 1
                log.warning(
                    "redis primary of %s moved from %s to %s (a failover)",
                    self.service_name,
                    _address(self.master_address),
                    _address(address),
                )
            self.master_address = address
            await self.disconnect(inuse_connections=False)
        self.check_fence()  # a connection being opened for a fenced loop: before it is used
        return address

    async def get_connection(self, *args, **kwargs):
        self.check_fence()  # a connection opened since by another loop
        return await super().get_connection(*args, **kwargs)

    def check_fence(self) -> None:
        fence = _FENCE.get()
        if fence is not None and fence.pool is self and fence.epoch != self.epoch:
            raise RedisFailedOver(
                f"the redis primary is now {_address(self.master_address)}: a failover, which "
                "may have lost the old primary's last writes"
            )

    async def aclose(self) -> None:
        await super().aclose()
        await self.sentinel_manager.aclose()


def _address(address: tuple[str, int] | None) -> str:
    return "none" if address is None else f"{address[0]}:{address[1]}"


def connect_sentinel(
    url: SentinelUrl, ca_file: Path | str | None = None, **kwargs: Any
) -> aioredis.Redis:
    """An asyncio client of the primary `url`'s Sentinels point at (`kwargs`: what each
    connection is opened with, as `redis.asyncio.from_url` takes them)."""
    sentinel = Sentinel(list(url.sentinels), sentinel_kwargs=_sentinel_args(url, ca_file))
    return sentinel.master_for(
        url.service,
        connection_pool_class=FencedPool,
        db=url.db,
        **_credentials(url),
        **_node_args(url, ca_file),
        **kwargs,
    )


def open_sentinel(url: SentinelUrl, ca_file: Path | str | None = None, **kwargs) -> redis.Redis:
    """A synchronous client of the primary (the CLI, the audits, the tests); unfenced."""
    sentinel = SyncSentinel(list(url.sentinels), sentinel_kwargs=_sentinel_args(url, ca_file))
    return sentinel.master_for(
        url.service, db=url.db, **_credentials(url), **_node_args(url, ca_file), **kwargs
    )


@contextmanager
def fenced(r: aioredis.Redis) -> Iterator[None]:
    """Within the block (and in the tasks started in it), commands on `r` raise
    `RedisFailedOver` once `r` has connected to another primary than the one it had when the
    block began. A no-op on a client of a plain redis:// URL."""
    pool = r.connection_pool
    if not isinstance(pool, FencedPool):
        yield
        return
    token = _FENCE.set(Fence(pool, pool.epoch))
    try:
        yield
    finally:
        _FENCE.reset(token)


def primary_of(r: aioredis.Redis) -> str | None:
    """host:port of the primary `r` connected to last (Sentinel's view of it); None for a
    client of a plain redis:// URL, or one that has not connected yet."""
    pool = r.connection_pool
    if not isinstance(pool, FencedPool) or pool.master_address is None:
        return None
    return _address(pool.master_address)


class ReplicaWait:
    """Writes that must survive a failover: each is sent, then WAIT on the same connection until
    `replicas` replicas hold everything the primary had when it applied it (every client's
    earlier writes included), or `timeout_ms` passed. Fewer is logged and counted, not raised:
    the write stands on the primary, and a failover that loses it is what the services detect
    (docs/reliability.md). While the replicas are away (the last wait came back short) a wait
    lasts `away_ms` at most, so that each write does not pay the whole timeout; once they
    answer again, `timeout_ms`. With `replicas` 0 a write is a plain write."""

    def __init__(self, replicas: int = 0, timeout_ms: int = 1000, away_ms: int = 50) -> None:
        self.replicas, self.timeout_ms, self.away_ms = replicas, timeout_ms, away_ms
        self.away = False

    async def write(self, r: aioredis.Redis, stage: Callable[[Any], None], what: str) -> int:
        """Send what `stage(pipe)` stages and wait; the replicas that had it in time."""
        timeout_ms = self.away_ms if self.away else self.timeout_ms
        async with r.pipeline(transaction=False) as pipe:
            stage(pipe)
            if self.replicas > 0:
                pipe.wait(self.replicas, timeout_ms)
            replies = await pipe.execute()
        if self.replicas <= 0:
            return 0
        acked = int(replies[-1])
        short = acked < self.replicas
        if short:
            WAIT_SHORT.inc()
        if short != self.away:
            self.away = short
            say = log.warning if short else log.info
            say(
                "%s: %d of %d redis replicas had it within %d ms%s",
                what,
                acked,
                self.replicas,
                timeout_ms,
                "; writes stand on the primary alone until they answer" if short else "",
            )
        return acked

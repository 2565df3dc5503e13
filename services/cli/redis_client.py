"""A synchronous Redis client for the CLI, the tests and the benchmarks, over TLS where the URL
says rediss:// (the server's certificate checked against a CA file), of the primary Sentinel
points at where it says redis+sentinel:// (`services.infra.redis_failover`)."""

from pathlib import Path

import redis

from services.infra.redis_failover import open_sentinel
from services.infra.sentinel_url import parse_sentinel_url


def open_redis(url: str, ca_file: Path | str | None = None, **kwargs) -> redis.Redis:
    """A client of `url`; with rediss:// and `ca_file`, the server is verified against it."""
    sentinel = parse_sentinel_url(url)
    if sentinel is not None:
        return open_sentinel(sentinel, ca_file, **kwargs)
    if ca_file is not None and url.startswith("rediss://"):
        kwargs["ssl_ca_certs"] = str(ca_file)
    return redis.Redis.from_url(url, **kwargs)

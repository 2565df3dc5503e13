"""A synchronous Redis client for the CLI, the tests and the benchmarks, over TLS where the URL
says rediss:// (the server's certificate checked against a CA file)."""

from pathlib import Path

import redis

from services.infra.redis_streams import tls_args


def open_redis(url: str, ca_file: Path | str | None = None, **kwargs) -> redis.Redis:
    """A client of `url`; with rediss:// and `ca_file`, the server is verified against it."""
    return redis.Redis.from_url(url, **tls_args(url, ca_file), **kwargs)

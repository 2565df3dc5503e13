"""A synchronous Redis client for the CLI, the tests and the benchmarks, over TLS where the URL
says rediss:// (the server's certificate checked against a CA file)."""

from pathlib import Path

import redis


def open_redis(url: str, ca_file: Path | str | None = None, **kwargs) -> redis.Redis:
    """A client of `url`; with rediss:// and `ca_file`, the server is verified against it."""
    if ca_file is not None and url.startswith("rediss://"):
        kwargs["ssl_ca_certs"] = str(ca_file)
    return redis.Redis.from_url(url, **kwargs)

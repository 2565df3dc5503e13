"""The URL of a Redis reached through Sentinel, parsed (pure: no I/O, the settings check it):

    redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/DB]

names the Sentinels, the service (Sentinel's master name) and the database; rediss+sentinel://
speaks TLS to the Sentinels and to the Redis nodes. The user and password are the Redis nodes';
the Sentinels are reached without credentials. `services.infra.redis_failover` connects.
"""

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    service: str  # Sentinel's name of the primary (`sentinel monitor NAME ...`)
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False


def parse_sentinel_url(url: str) -> SentinelUrl | None:
    """The Sentinels, service and database a redis+sentinel:// URL names; None for any other
    URL. A ValueError says what is wrong with a malformed one (never quoting its password)."""
    scheme = url.partition("://")[0].lower()
    if scheme not in SCHEMES:
        return None
    parts = urlsplit(url)
    credentials, _, hosts = parts.netloc.rpartition("@")
    username, _, password = credentials.partition(":")
    sentinels = tuple(_host_port(h) for h in hosts.split(",") if h.strip())
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(
            f"a {scheme}:// URL is {scheme}://[user:password@]host:port[,host:port...]"
            "/SERVICE[/DB]: it names the Sentinels, the service and the database"
        )
    return SentinelUrl(
        sentinels,
        unquote(path[0]),
        int(path[1]) if len(path) == 2 else 0,
        unquote(username) or None,
        unquote(password) if credentials and password else None,
        SCHEMES[scheme],
    )


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a Sentinel is host:port, not {text.strip()!r}")
    return host.strip("[]"), int(port)

"""Settings shared by every service, read from the environment (prefix SPOTRL_).

Each service extends `CommonSettings` with its own fields. Secrets have no default.
A service bound to an address off loopback refuses to start without a token.
"""

import ipaddress
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.infra.connection_limits import LOOPBACK, ConnectionLimits, parse_networks
from services.infra.scopes import parse_accept
from services.infra.sentinel_url import parse_sentinel_url


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; anything else (0.0.0.0, ::, a name) is reachable."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CommonSettings(BaseSettings):
    # errors never print the input: it holds the token and URLs with passwords
    model_config = SettingsConfigDict(
        env_prefix="SPOTRL_", extra="ignore", hide_input_in_errors=True
    )

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis holding all run state: redis:// (rediss:// over TLS), or "
        "redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/DB] "
        "(rediss+sentinel://) for the primary those Sentinels name, followed through a "
        "failover (docs/reliability.md, Redis failover).",
    )
    api_token: str | None = Field(
        None,
        description="The admin bearer token: accepted on every route. With it or "
        "`accept_tokens` set, every write needs a token of its route's scope; open when unset.",
    )
    token: str | None = Field(
        None,
        description="This process's own bearer token, sent on its HTTP calls (registration, "
        "weight uploads and pulls, peers): a worker's or the trainer's scoped token. Unset: "
        "`api_token` is sent.",
    )
    accept_tokens: str | None = Field(
        None,
        max_length=64 * 1024,
        description="Tokens this service accepts besides `api_token`, by their SHA-256: a comma "
        "list of `scope:sha256hex` (scopes admin, worker, trainer, read; "
        "services.infra.scopes.accept_list renders it).",
    )
    protect_reads: bool = Field(
        False,
        description="Also require a bearer token on reads (/healthz stays open for probes).",
    )
    coordinator_url: str = Field("http://127.0.0.1:8100", description="Coordinator base URL.")
    weightstore_url: str = Field(
        "http://127.0.0.1:8200", description="Weight store base URL (comma-separated replicas)."
    )
    host: str = Field("127.0.0.1", description="Interface this service's HTTP server binds.")
    port_file: Path | None = Field(
        None,
        description="Write the port bound (port 0: a free one) and this process's id here; "
        "`python -m services.infra.healthcheck` probes that port and that process.",
    )
    log_level: str = Field("INFO", description="Python logging level.")
    torch_threads: int = Field(1, ge=1, le=256, description="torch intra-op threads.")
    cpus: str | None = Field(
        None,
        pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$",
        max_length=256,
        description="CPU cores the trainer or a rollout worker runs on (Linux affinity, set at "
        "start), e.g. '0' or '0-3,8': services that share a machine keep off each other's "
        "cores, as they would on their own hardware. None: every core.",
    )
    gpu_memory_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of the GPU's memory this service may allocate (torch's per-process "
        "fraction, set before its first allocation), for services that share a GPU, as a "
        "reserved node's trainer and rollout workers do. None: no bound.",
    )
    max_body_bytes: int = Field(
        64 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest request body of a JSON route (a run spec, a worker); 413 past it.",
    )
    http_header_timeout_s: float = Field(
        10.0,
        ge=0.5,
        le=600.0,
        description="A request's headers must be in this many seconds after its first byte (a "
        "new connection's: after it opened); the connection is closed past it, on every HTTP "
        "server of the service (its API, a block or peer server).",
    )
    http_body_timeout_s: float = Field(
        30.0,
        ge=1.0,
        le=3600.0,
        description="A request body may take this many seconds plus its bytes over "
        "`http_body_min_bytes_per_s` (time the server is not reading does not count); the "
        "connection is closed past it.",
    )
    http_body_min_bytes_per_s: int = Field(
        64 * 1024,
        ge=1,
        le=1024**3,
        description="The slowest a long body (a weight upload) may come, on average, once "
        "`http_body_timeout_s` is spent.",
    )
    http_connections_per_client: int = Field(
        128,
        ge=1,
        le=1_000_000,
        description="Open connections one client address may hold on each HTTP server; one "
        "past it is closed at once. Addresses in `http_uncapped_clients` have no cap.",
    )
    http_uncapped_clients: str = Field(
        LOOPBACK,
        max_length=4096,
        description="Client addresses or networks (a comma list) without a connection cap: "
        "loopback, where every process of a machine shares one address; add a proxy that "
        "many clients come through. Empty: none.",
    )
    tls_cert_file: Path | None = Field(
        None,
        description="This service's TLS certificate (PEM, chain first): its HTTP server and a "
        "worker's block/peer server speak HTTPS with it. Unset: plain HTTP.",
    )
    tls_key_file: Path | None = Field(
        None, description="The private key of `tls_cert_file` (PEM); set both or neither."
    )
    tls_ca_file: Path | None = Field(
        None,
        description="CA bundle (PEM) this process's clients verify https:// and rediss:// peers "
        "against. Unset: the system's trust store.",
    )
    tls_reload_interval_s: float = Field(
        30.0,
        ge=1.0,
        le=3600.0,
        description="How often a service serving TLS checks its certificate, key and CA files "
        "for a change; a renewed pair is served to new connections without a restart.",
    )
    tls_warn_days: int = Field(
        30,
        ge=0,
        le=825,
        description="Log a warning (at start, at each reload, then daily) when the served "
        "certificate expires within this many days; 0: never.",
    )

    @field_validator("api_token", "token", "accept_tokens")
    @classmethod
    def _empty_token_is_none(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("redis_url")
    @classmethod
    def _sentinel_url_parses(cls, value: str) -> str:
        parse_sentinel_url(value)  # a ValueError says the form, never the password
        return value

    @field_validator("accept_tokens")
    @classmethod
    def _accept_list_parses(cls, value: str | None) -> str | None:
        parse_accept(value)  # a ValueError names the entry, never the digest
        return value

    @field_validator("http_uncapped_clients")
    @classmethod
    def _networks_parse(cls, value: str) -> str:
        parse_networks(value)  # a ValueError names the entry
        return value

    @field_validator("tls_cert_file", "tls_key_file", "tls_ca_file", mode="before")
    @classmethod
    def _empty_path_is_none(cls, value: Any) -> Any:
        return value or None

    @model_validator(mode="after")
    def _cert_with_key(self) -> "CommonSettings":
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set SPOTRL_TLS_CERT_FILE and SPOTRL_TLS_KEY_FILE together")
        return self

    @model_validator(mode="after")
    def _no_open_writes_off_loopback(self) -> "CommonSettings":
        if self.api_token is None and self.accept_tokens is None and not is_loopback(self.host):
            raise ValueError(
                f"host {self.host} is not a loopback address and no API token is set: anyone "
                "who reaches it could submit runs and upload weights. Set SPOTRL_API_TOKEN "
                "(clients send it as a bearer token) or SPOTRL_ACCEPT_TOKENS, or bind to "
                "127.0.0.1 (SPOTRL_HOST)."
            )
        return self

    def outgoing_token(self) -> str | None:
        """The bearer token this process sends: its own `token`, else `api_token`."""
        return self.token or self.api_token

    def connection_limits(self) -> ConnectionLimits:
        """What a client may hold of this service's HTTP servers and how long it may take."""
        return ConnectionLimits(
            self.http_header_timeout_s,
            self.http_body_timeout_s,
            self.http_body_min_bytes_per_s,
            self.http_connections_per_client,
            parse_networks(self.http_uncapped_clients),
        )

    def weightstore_urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.weightstore_url.split(",") if u.strip()]


def env_name(settings: type[BaseSettings], field: str) -> str:
    """The environment variable that sets `field` of a settings class (`SPOTRL_` + its name in
    capitals); KeyError for a field the class does not have."""
    if field not in settings.model_fields:
        raise KeyError(f"{settings.__name__} has no setting {field!r}")
    return f"{settings.model_config.get('env_prefix', '')}{field}".upper()


def env_value(value: Any) -> str:
    """A setting's value as pydantic-settings reads it back from the environment."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def settings_env(settings: type[BaseSettings], **values: Any) -> dict[str, str]:
    """The environment that gives these fields of a settings class these values, e.g.
    `settings_env(RolloutSettings, slots=16) == {"SPOTRL_SLOTS": "16"}`. Names are checked
    against the class (a misspelt one is an error, not a setting silently ignored) and may be
    given in either case; a value of None is left out (the field keeps its default)."""
    names = {field: env_name(settings, field.lower()) for field in values}
    return {names[field]: env_value(value) for field, value in values.items() if value is not None}

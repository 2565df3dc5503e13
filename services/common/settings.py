"""Settings shared by every service, read from the environment (prefix SPOTRL_).

Each service extends `CommonSettings` with its own fields. Secrets have no default.
"""

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPOTRL_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding all run state.")
    api_token: str | None = Field(
        None, description="Bearer token required on every write when set; open when unset."
    )
    protect_reads: bool = Field(
        False,
        description="Also require the bearer token on reads (/healthz stays open for probes).",
    )
    coordinator_url: str = Field("http://127.0.0.1:8100", description="Coordinator base URL.")
    weightstore_url: str = Field(
        "http://127.0.0.1:8200", description="Weight store base URL (comma-separated replicas)."
    )
    host: str = Field("127.0.0.1", description="Interface this service's HTTP server binds.")
    log_level: str = Field("INFO", description="Python logging level.")
    torch_threads: int = Field(1, ge=1, le=256, description="torch intra-op threads.")

    @field_validator("api_token")
    @classmethod
    def _empty_token_is_none(cls, value: str | None) -> str | None:
        return value or None

    def weightstore_urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.weightstore_url.split(",") if u.strip()]

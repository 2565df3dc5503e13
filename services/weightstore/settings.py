import socket
import uuid
from pathlib import Path

from pydantic import Field, model_validator

from services.infra.settings import CommonSettings


class WeightStoreSettings(CommonSettings):
    port: int = Field(8200, ge=0, le=65535, description="HTTP port.")
    root: Path = Field(Path(".spotrl/weights"), description="Folder holding every version.")
    replica_id: str = Field(
        "",
        max_length=120,
        description="Name of this replica's staging area (default: host name and port, the same "
        "across restarts and different for replicas sharing a host name).",
    )
    stale_staging_s: float = Field(
        3600.0,
        ge=60,
        le=30 * 86400,
        description="Another replica's staging untouched this long is an upload cut off: removed.",
    )
    block_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the zero-copy file server (sendfile) that pullers fetch blocks from "
        "(0: any free port; clients learn it from GET /v1/blocks).",
    )
    serve_blocks: bool = Field(
        True, description="Run the block server; false: files are served by the API only."
    )
    block_bytes: int = Field(
        32 * 1024 * 1024,
        ge=64 * 1024,
        le=1024**3,
        description="Block size of new uploads: a puller fetches and checks one block at a time.",
    )
    max_serving: int = Field(
        64, ge=1, le=4096, description="Block responses at once; past that, 503 (busy)."
    )
    egress_mbps: float | None = Field(
        None, gt=0, description="Cap on the block server's egress, megabits per second."
    )
    keep_versions: int = Field(
        4,
        ge=1,
        le=10000,
        description="Committed versions kept per model (with the versions their deltas need).",
    )
    full_every: int = Field(
        8,
        ge=1,
        le=10000,
        description="A version committed as deltas is kept whole when its number is a multiple "
        "of this (a joiner starts from the nearest one); the others keep their deltas only.",
    )
    max_file_bytes: int = Field(
        64 * 1024**3,
        ge=1024,
        le=2**50,
        description="Largest file one upload may carry (a weight shard); 413 past it.",
    )
    max_manifest_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        le=1024**3,
        description="Largest manifest a commit may carry; 413 past it.",
    )

    @model_validator(mode="after")
    def _replica_by_host_and_port(self) -> "WeightStoreSettings":
        if not self.replica_id:
            suffix = str(self.port) if self.port else uuid.uuid4().hex[:8]  # port 0: any
            self.replica_id = f"{socket.gethostname()[:60]}-{suffix}"
        return self

import socket
from pathlib import Path

from pydantic import Field

from services.common.settings import CommonSettings


class WeightStoreSettings(CommonSettings):
    port: int = Field(8200, ge=0, le=65535, description="HTTP port.")
    root: Path = Field(Path(".spotrl/weights"), description="Folder holding every version.")
    replica_id: str = Field(
        default_factory=socket.gethostname, description="Name of this replica's staging area."
    )
    keep_versions: int = Field(4, ge=1, le=10000, description="Committed versions kept per model.")

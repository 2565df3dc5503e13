from pydantic import Field

from services.common.settings import CommonSettings


class CoordinatorSettings(CommonSettings):
    port: int = Field(8100, ge=0, le=65535, description="HTTP port.")
    scheduler_poll_s: float = Field(0.2, gt=0, le=60, description="Idle poll of the run queue.")
    observe_s: float = Field(
        2.0, gt=0, le=300, description="Period of the pool, tokens/s and queue-depth samples."
    )

from collections.abc import Collection
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import NoDecode

from services.contracts.runspec import USER_REWARD
from services.core.run_admission import TokenLimits
from services.infra.settings import CommonSettings
from services.tasks.dataset_files import DatasetLimits


@dataclass(frozen=True)
class EnvironmentLimits:
    """What the coordinator's settings allow a run's environment."""

    modules: Collection[str] = ()  # user environments' modules allowed
    processes: int = 2
    memory_limit_mb: int = 2048
    allow_network: bool = False


class CoordinatorSettings(CommonSettings):
    port: int = Field(8100, ge=0, le=65535, description="HTTP port.")
    scheduler_poll_s: float = Field(0.2, gt=0, le=60, description="Idle poll of the run queue.")
    max_active_runs: int = Field(
        1,
        ge=1,
        le=16,
        description=(
            "Runs active at once, sharing the fleet's workers by fair shares (docs/many_runs.md);"
            " a second and later run is activated only while a trainer of the pool is idle for"
            " it. 1: one run at a time, the others wait in the queue."
        ),
    )
    max_active_runs_per_token: int = Field(
        0,
        ge=0,
        le=16,
        description=(
            "The most active runs of one submitting token (a run is counted under the bearer "
            "token it was submitted with; without tokens, every run under one); a run past it "
            "waits in the queue and later runs of other tokens go first. 0: no limit."
        ),
    )
    max_share_per_token: float = Field(
        0.0,
        ge=0,
        le=16_000,
        description=(
            "The most summed rollout.share of one submitting token's active runs; a run past it "
            "waits in the queue, and a run whose share alone is above it is refused (422). "
            "0: no limit."
        ),
    )
    placement_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="With several runs active: how often the fleet's workers are placed among "
        "them by fair shares; a run's work coming or going places them at once too.",
    )
    placement_switch_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="With several runs active: a worker its run does not need switches to a "
        "run short of at least this share of its slots (a switch loads the other run's "
        "weights); 0 where loads take a moment (small models): an idle worker then serves any "
        "run with work waiting.",
    )
    observe_s: float = Field(
        2.0, gt=0, le=300, description="Period of the pool, tokens/s and queue-depth samples."
    )
    stall_after_s: float = Field(
        3.0,
        gt=0,
        le=3600,
        description="A run whose step has had no live worker able to serve it (a worker still "
        "loading the step's weights counts) for this long is stalled.",
    )
    max_step_requests: int = Field(
        65536,
        ge=1,
        le=2**24,
        description="Most requests one step may create (prompts_per_step x group_size); "
        "a run spec over it is refused.",
    )
    max_step_tokens: int = Field(
        2**27,
        ge=1,
        le=2**40,
        description="Most response tokens one step may ask for (prompts_per_step x group_size "
        "x max_new_tokens); a run spec over it is refused.",
    )
    max_task_file_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1,
        le=2**40,
        description="Largest task file (task_path) or dataset file (Parquet: its data "
        "uncompressed too) a run spec may name.",
    )
    max_dataset_rows: int = Field(
        1_000_000, ge=1, le=10**9, description="Most rows a run's dataset may have."
    )
    max_prompt_chars: int = Field(
        65_536, ge=1, le=2**24, description="Longest prompt of a dataset row (after its template)."
    )
    reward_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Modules whose functions a run spec may name as its reward "
        "(module:function), comma-separated; the operator makes them importable (PYTHONPATH). "
        "Empty: built-in rewards only.",
    )
    reward_processes: int = Field(
        1,
        ge=1,
        le=64,
        description="Processes that run a reward that may hang (a user function, regex_match, "
        "boxed_match), each killed and started again when a call takes longer than the spec's "
        "reward_timeout_s.",
    )
    environment_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Modules whose classes a run spec may name as its environment "
        "(module:Class), comma-separated; the operator makes them importable (PYTHONPATH). "
        "Empty: built-in environments only.",
    )
    environment_processes: int = Field(
        2,
        ge=1,
        le=64,
        description="Processes that run a multi-turn run's environment (one call each at a "
        "time), each killed and started again when a call takes longer than the spec's "
        "environment_timeout_s.",
    )
    environment_memory_mb: int = Field(
        2048,
        ge=64,
        le=1 << 20,
        description="Address space of each environment process (RLIMIT_AS); a call past it "
        "fails and is counted.",
    )
    environment_network: bool = Field(
        False,
        description="Let environments reach the network (False: each environment process "
        "runs in a network namespace of its own, with no interface up).",
    )
    audit_ttl_s: int = Field(
        600,
        ge=0,
        le=30 * 86400,
        description="How long a finished run's groups and deltas streams stay for audits "
        "(a cancelled run's go at once, with its jobs and request tables).",
    )
    redis_memory_limit_mb: int = Field(
        0,
        ge=0,
        le=2**24,
        description="Redis memory the coordinator brakes at (0: Redis's own maxmemory; with "
        "neither, no brake).",
    )
    redis_memory_high: float = Field(
        0.85,
        gt=0,
        le=1,
        description="Share of that limit above which no new step is queued: the run is "
        "stalled with the reason until memory falls under it.",
    )
    forget_workers_after_s: float = Field(
        3600.0,
        gt=0,
        le=30 * 86400,
        description="A worker gone (no heartbeat) this long is dropped from the worker list, "
        "with its control stream and crash report: churn over days does not pile up.",
    )
    read_refresh_s: float = Field(
        0.1,
        gt=0,
        le=60,
        description="Period of the control plane's read model: what the REST API, the "
        "dashboard and the metrics answer is at most this old.",
    )
    read_rate_per_s: float = Field(
        10.0,
        gt=0,
        le=100_000,
        description="Reads (GET) one client (one address) may make a second; past it and its "
        "burst, a read is answered 429 with Retry-After.",
    )
    read_burst: int = Field(
        20, ge=1, le=1_000_000, description="Reads one client may make at once above its rate."
    )
    worker_redis_users: bool = Field(
        False,
        description="Give each rollout worker its own Redis user (ACL SETUSER, its password "
        "answered at registration) and a key it signs its delta batches with; a batch not "
        "signed by the worker it names is parked. Needs a coordinator Redis user that may "
        "manage users (services.contracts.access).",
    )

    @field_validator("reward_modules", "environment_modules", mode="before")
    @classmethod
    def _split_modules(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, str):
            value = [m.strip() for m in value.split(",") if m.strip()]
        if isinstance(value, list):
            for module in value:
                if not isinstance(module, str) or not USER_REWARD.fullmatch(f"{module}:f"):
                    raise ValueError(f"{info.field_name}: comma-separated module.path names")
        return value

    def environment_limits(self) -> EnvironmentLimits:
        return EnvironmentLimits(
            tuple(self.environment_modules),
            self.environment_processes,
            self.environment_memory_mb,
            self.environment_network,
        )

    def token_limits(self) -> TokenLimits:
        """What one submitting token may hold active (`core.run_admission`)."""
        return TokenLimits(self.max_active_runs_per_token, self.max_share_per_token)

    def dataset_limits(self) -> DatasetLimits:
        return DatasetLimits(self.max_task_file_bytes, self.max_dataset_rows, self.max_prompt_chars)

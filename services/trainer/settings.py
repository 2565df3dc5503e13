from pathlib import Path

from pydantic import Field

from services.infra.settings import CommonSettings


class TrainerSettings(CommonSettings):
    port: int = Field(8300, ge=0, le=65535, description="HTTP port (health, metrics, status).")
    work_dir: Path = Field(Path(".spotrl/trainer"), description="Scratch folder for exports.")
    device: str = Field("cpu", description="torch device for training, e.g. cpu or cuda.")
    weight_deltas: bool = Field(
        True,
        description="Commit each changed safetensors file of a version as a sparse delta of "
        "the version before, where that is at most half its size (the store makes it whole and "
        "checks it); false: every changed file is sent whole.",
    )
    trainer_ranks: int = Field(
        1,
        ge=1,
        le=1024,
        description="Train on this many ranks on this machine (torchrun, FSDP2): one per GPU "
        "with device cuda, processes on gloo with cpu. Rank 0 is the service.",
    )
    poll_s: float = Field(0.1, gt=0, le=60, description="Idle poll of the active run.")
    trainer_id: str = Field(
        "trainer",
        pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="This trainer's name in the trainer pool: each trainer of a deployment "
        "that runs several at once has its own; a restart keeps it (and so its run).",
    )
    checkpoint_every: int = Field(
        10,
        ge=1,
        le=100000,
        description="Checkpoint the trainer's state (optimizer moments, RNG) every K steps, in "
        "the background, and at exit; the weights of every step are in the weight store.",
    )
    checkpoint_every_s: float = Field(
        300.0,
        gt=0,
        le=30 * 86400,
        description="Also checkpoint once this many seconds passed since the last checkpoint.",
    )
    keep_checkpoints: int = Field(2, ge=1, le=100, description="Newest checkpoints kept.")
    redis_wait_replicas: int = Field(
        0,
        ge=0,
        le=16,
        description="Before a version's weights go to the store, wait (Redis WAIT) until this "
        "many replicas hold its digest and everything written before it (the step's groups "
        "and ledger), so that a failover cannot lose what the version was trained on: 1 with "
        "a replica and Sentinel; 0: no wait (a plain Redis).",
    )
    redis_wait_timeout_ms: int = Field(
        1000,
        ge=1,
        le=60_000,
        description="The longest that wait lasts; fewer replicas by then is logged and counted "
        "(spotrl_redis_wait_short_total), and the commit goes on. While they stay away (the "
        "last wait came back short) a wait lasts 50 ms at most.",
    )
    rollouts_dir: Path | None = Field(
        None,
        description="Write every step's trained groups (prompt, responses, token ids, logprobs, "
        "rewards) as JSON lines to DIR/<run>/step-NNNNNN.jsonl, for inspection. Off by default: "
        "it grows with the run.",
    )

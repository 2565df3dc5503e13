"""The run spec: what a user submits (REST or CLI) and what every service reads back.

Validation lives here, so the API and the CLI reject the same things with the same field names.
"""

import codecs
import json
import stat
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RunState = Literal["queued", "running", "stalled", "succeeded", "failed", "cancelled"]
FINAL_STATES = ("succeeded", "failed", "cancelled")
# A stalled run is still live: it goes back to running as soon as it can progress again.
LIVE_STATES = ("running", "stalled")


MAX_PATH_CHARS = 4096
CONFIG_MAX_BYTES = 16 * 1024 * 1024  # a model's config.json
READ_BLOCK_BYTES = 1024 * 1024


class ModelFolderError(ValueError):
    """The model folder named by a spec is missing or is not a Hugging Face model folder."""


class TaskFileError(ValueError):
    """The task file named by a spec is missing, unreadable, too large or not UTF-8 text."""


def shorten_path(path: str | Path) -> str:
    """A path as error messages name it: cut short when long, never with file content."""
    text = str(path)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def check_text_file(path: str, max_bytes: int) -> None:
    """Raise TaskFileError unless `path` is a regular, readable file of at most `max_bytes`
    bytes of UTF-8 text (all of it is read, in blocks)."""
    name = f"task file {shorten_path(path)}"
    try:
        info = Path(path).stat()
    except FileNotFoundError:
        raise TaskFileError(f"{name} does not exist") from None
    except OSError as exc:
        raise TaskFileError(f"{name} cannot be read: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise TaskFileError(f"{name} is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise TaskFileError(f"{name} is not a regular file")
    if info.st_size > max_bytes:
        raise TaskFileError(
            f"{name} is {info.st_size} bytes, over the limit of {max_bytes} bytes "
            "(SPOTRL_MAX_TASK_FILE_BYTES)"
        )
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with open(path, "rb") as fh:
            while block := fh.read(min(READ_BLOCK_BYTES, max_bytes + 1 - offset)):
                decoder.decode(block)
                offset += len(block)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        where = offset + exc.start
        raise TaskFileError(f"{name} is not UTF-8 text (invalid byte at offset {where})") from None
    except OSError as exc:
        raise TaskFileError(f"{name} cannot be read: {exc.strerror}") from None
    if offset > max_bytes:
        raise TaskFileError(f"{name} grew past the limit of {max_bytes} bytes")


class RunSpec(BaseModel):
    # JSON has no NaN or Infinity: a spec with them is refused, never stored
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field("", max_length=200, description="Free text shown in listings.")
    model: str = Field(
        min_length=1,
        max_length=MAX_PATH_CHARS,
        description="Local Hugging Face model folder to train.",
    )
    task: Literal["arithmetic", "math"] = Field("arithmetic", description="Built-in task.")
    task_path: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PATH_CHARS,
        description="JSONL file for the math task (UTF-8, at most the coordinator's "
        "max_task_file_bytes).",
    )
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
    fair_reads: bool = Field(
        True,
        description="Each worker holds at most an equal share of a step's unfinished requests "
        "among the workers serving or loading its version, and the balancer evens executing "
        "requests out (False: a worker reads up to its plateau batch size, as in the paper).",
    )
    seeding_wait_share: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="T_seed grows while the trainer waits for groups after the seeding window "
        "longer than this share of its compute time, and shrinks below it.",
    )
    seeding_backoff: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="Share of the seeding window dropped after a step whose trainer waited "
        "less than seeding_wait_share (a longer window only delays training).",
    )
    pool_headroom: float = Field(
        1.1,
        ge=1.0,
        le=10.0,
        description="The preemptible pool size the coordinator asks a scaler for "
        "(`preemptible_wanted` in the run's status): N_prem, the size past which the step gets "
        "no shorter (mean of the last 3 steps), times this, rounded up.",
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

    @field_validator("model", "task_path")
    @classmethod
    def _no_nul_in_paths(cls, value: str | None) -> str | None:
        if value is not None and "\x00" in value:
            raise ValueError("a path cannot contain a NUL character")
        return value

    @model_validator(mode="after")
    def _check_task_path(self) -> "RunSpec":
        if self.task_path is not None and self.task != "math":
            raise ValueError("task_path is only used by the math task")
        return self

    def check_task_file(self, max_bytes: int) -> None:
        """Raise TaskFileError unless `task_path` (when given) is a readable UTF-8 file of at
        most `max_bytes` bytes."""
        if self.task_path is not None:
            check_text_file(self.task_path, max_bytes)

    def check_model_folder(self) -> None:
        """Raise ModelFolderError unless `model` is a readable model folder."""
        try:
            self._check_model_folder()
        except OSError as exc:  # a name too long, a folder that cannot be listed
            raise ModelFolderError(
                f"model folder {shorten_path(self.model)} cannot be read: {exc.strerror}"
            ) from None

    def _check_model_folder(self) -> None:
        folder, name = Path(self.model), shorten_path(self.model)
        if not folder.is_dir():
            raise ModelFolderError(f"model folder {name} does not exist")
        for required in ("config.json", "tokenizer.json"):
            if not (folder / required).is_file():
                raise ModelFolderError(f"model folder {name} has no {required}")
        if not any(folder.glob("*.safetensors")):
            raise ModelFolderError(f"model folder {name} has no .safetensors weights")
        config_path = folder / "config.json"
        if config_path.stat().st_size > CONFIG_MAX_BYTES:
            raise ModelFolderError(f"{shorten_path(config_path)} is over {CONFIG_MAX_BYTES} bytes")
        try:
            config = json.loads(config_path.read_bytes().decode())
        except UnicodeDecodeError:
            raise ModelFolderError(f"{shorten_path(config_path)} is not UTF-8 text") from None
        except (ValueError, RecursionError) as exc:
            raise ModelFolderError(
                f"{shorten_path(config_path)} is not valid JSON: {exc}"
            ) from None
        if not isinstance(config, dict):
            raise ModelFolderError(f"{shorten_path(config_path)} is not a JSON object")
        context = config.get("max_position_embeddings")
        if isinstance(context, int) and self.max_new_tokens >= context:
            raise ModelFolderError(
                f"max_new_tokens {self.max_new_tokens} leaves no room for a prompt in the "
                f"model's context of {context} tokens (max_position_embeddings)"
            )


# The embedded default run (`spotrl up`, `make up`): its choices where they differ from a spec's
# own defaults above, in one place. With them the small arithmetic model that `spotrl init-model`
# builds climbs from about 0.35 to 0.55 reward in 40 steps of 32 prompts x 8 responses of at most
# 6 tokens (under a minute of RL on 2 CPU cores; README), and a run stalled for 5 minutes fails
# rather than waits for ever. A spec submitted over REST or as TOML gets RunSpec's defaults;
# `spotrl up` applies this preset on top of them, and each of its flags overrides both.
EMBEDDED_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "steps": 40,
        "prompts_per_step": 32,
        "max_new_tokens": 6,
        "stall_timeout_s": 300.0,
    }
)
# Pre-training steps of the base model that `spotrl up` and `spotrl init-model` build when no
# model folder is named (about two minutes on 2 CPU cores).
EMBEDDED_PRETRAIN_STEPS = 1000

"""The run spec: what a user submits (REST or CLI) and what every service reads back.

Validation lives here, so the API and the CLI reject the same things with the same field names.
"""

import codecs
import json
import re
import stat
import string
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from services.contracts.shards import MAX_COORDINATOR_SHARDS

RunState = Literal["queued", "running", "stalled", "succeeded", "failed", "cancelled"]
FINAL_STATES = ("succeeded", "failed", "cancelled")
# A stalled run is still live: it goes back to running as soon as it can progress again.
LIVE_STATES = ("running", "stalled")


MAX_PATH_CHARS = 4096
# a prompt template or system prompt: a longer one, even in JSON's 12-byte escapes, would make a
# body over the API's default limit (64 KiB, a 413) rather than a clear 422
MAX_TEXT_CHARS = 4096
CONFIG_MAX_BYTES = 16 * 1024 * 1024  # a model's config.json
READ_BLOCK_BYTES = 1024 * 1024


# The rewards a spec names without code; the functions are in services/tasks/rewards.py.
BUILTIN_REWARDS = ("exact_match", "numeric_match", "regex_match", "boxed_match")
# A user reward: `module.path:function`, importable where the coordinator runs.
USER_REWARD = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)
# Fields that only a `dataset` run reads: a built-in task has its own and refuses others.
DATASET_FIELDS = (
    "dataset_split",
    "prompt_field",
    "answer_field",
    "prompt_template",
    "reward",
    "answer_regex",
    "reward_tolerance",
)
MAX_FORMAT_DIGITS = 4  # widths and precisions in a prompt template: at most 9999


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


def template_fields(template: str) -> list[str]:
    """The row fields a prompt template names; ValueError unless it is a format string over
    plain field names (`{question}`, `{price:.2f}`): no positional, attribute or index fields,
    no nested or huge widths."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"not a valid format string: {exc}") from None
    names = []
    for _, name, spec, _ in parts:
        if name is None:
            continue
        if not name or name.isdigit():
            raise ValueError("a positional field ({} or {0}): name a row field, e.g. {question}")
        if "." in name or "[" in name:
            raise ValueError("attribute or index fields ({a.b}, {a[0]}): name a row field")
        if spec and ("{" in spec or re.search(rf"\d{{{MAX_FORMAT_DIGITS + 1},}}", spec)):
            raise ValueError("format specs may not nest fields or exceed a width of 9999")
        names.append(name)
    return names


class RunSpec(BaseModel):
    # JSON has no NaN or Infinity: a spec with them is refused, never stored
    # populate_by_name: a field with an old name (kl_coef, clip_range) is also set by its own
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str = Field("", max_length=200, description="Free text shown in listings.")
    model: str = Field(
        min_length=1,
        max_length=MAX_PATH_CHARS,
        description="Local Hugging Face model folder to train.",
    )
    task: Literal["arithmetic", "math", "dataset"] = Field(
        "arithmetic",
        description="Where prompts and rewards come from: a built-in (arithmetic: generated "
        "sums, exact match; math: GSM8K rows, their final number checked by math_verify) "
        "or `dataset` (the run's own file and reward, below; chosen when `dataset` is set).",
    )
    task_path: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PATH_CHARS,
        description="JSONL file for the math task (UTF-8, at most the coordinator's "
        "max_task_file_bytes).",
    )
    dataset: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PATH_CHARS,
        description="The run's prompts: a .jsonl or .parquet file on the services' shared "
        "storage, or a name the `datasets` library loads (where it is installed).",
    )
    dataset_split: str = Field(
        "train", min_length=1, max_length=200, description="Split of a `datasets` dataset."
    )
    prompt_field: str = Field(
        "prompt", min_length=1, max_length=200, description="Row field holding the prompt."
    )
    answer_field: str = Field(
        "answer",
        min_length=1,
        max_length=200,
        description="Row field holding the reference answer the reward compares against.",
    )
    prompt_template: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_TEXT_CHARS,
        description="Python format string over the row's fields, e.g. '{question}\\nAnswer:' "
        "(named fields only; None: the prompt field as it is).",
    )
    chat_template: bool = Field(
        False,
        description="Wrap each prompt as a user message in the model's chat template, with the "
        "generation prompt after it (tokenizer_config.json or chat_template.jinja must have "
        "one).",
    )
    system_prompt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_TEXT_CHARS,
        description="System message before the prompt, with chat_template.",
    )
    shuffle: bool = Field(
        True,
        description="Prompts in a shuffled order seeded by `seed`, shuffled again on each pass "
        "over the rows (False: the file's order, from the first row again after the last).",
    )
    reward: str = Field(
        "exact_match",
        min_length=1,
        max_length=400,
        description="Reward of a `dataset` run: exact_match, numeric_match (within "
        "reward_tolerance), regex_match (answer_regex's first group, then exact), boxed_match "
        "(math_verify), or module:function(prompt, response, example) -> float from a module "
        "on the coordinator's reward_modules allow list (example: the row, a dict).",
    )
    answer_regex: str | None = Field(
        None,
        min_length=1,
        max_length=1000,
        description="regex_match: the pattern whose first group (else whole match, the last "
        "one in the response) is the response's answer.",
    )
    reward_tolerance: float = Field(
        1e-6, ge=0.0, le=1e9, description="numeric_match: largest absolute difference scored 1."
    )
    reward_timeout_s: float = Field(
        5.0,
        gt=0.0,
        le=600.0,
        description="A reward call that takes longer scores 0 and is counted (reward_errors).",
    )
    group_size: int = Field(8, ge=1, le=256, description="Responses per prompt (n).")
    prompts_per_step: int = Field(16, ge=1, le=8192, description="Prompts per RL step (B).")
    steps: int = Field(
        20,
        ge=1,
        le=1_000_000,
        description="RL steps: each samples a batch and takes num_iterations optimizer steps "
        "on it.",
    )
    max_new_tokens: int = Field(8, ge=1, le=131072, description="Response token budget.")
    temperature: float = Field(
        1.0, ge=0.0, le=10.0, description="Sampling temperature; 0 = greedy."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(
        0, ge=0, le=1_000_000, description="Sample among the k likeliest tokens (0: all)."
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description="Penalise tokens already in the prompt or response: their positive logits "
        "divided by it, negative ones multiplied (> 1: fewer repeats; 1: off), as transformers "
        "and vLLM do.",
    )
    learning_rate: float = Field(1e-4, gt=0.0, lt=1.0, description="AdamW learning rate.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2.")
    weight_decay: float = Field(
        0.0,
        ge=0.0,
        le=10.0,
        description="AdamW (decoupled) weight decay, not applied to biases and norm weights.",
    )
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine"] = Field(
        "constant",
        description="Learning rate over the run's optimizer steps (steps x num_iterations), "
        "after warmup_steps: constant, or a straight line (linear) or half a cosine (cosine) "
        "down to 0 at the last; `constant` takes no warmup, `constant_with_warmup` does.",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Optimizer steps of linear warmup from 0 to learning_rate (the first is at "
        "0, as in transformers).",
    )
    max_grad_norm: float = Field(
        1.0,
        ge=0.0,
        le=1e6,
        description="Clip each optimizer step's gradient to this global norm (0: no clipping).",
    )
    beta: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        validation_alias=AliasChoices("beta", "kl_coef"),
        description="Coefficient of the KL to the initial policy (k3 estimator, per token; 0: "
        "no reference model). Was kl_coef, still accepted.",
    )
    epsilon: float = Field(
        0.2,
        gt=0.0,
        le=10.0,
        validation_alias=AliasChoices("epsilon", "clip_range"),
        description="PPO ratio clip: ratios outside [1 - epsilon, 1 + epsilon_high] are "
        "clipped. Was clip_range, still accepted.",
    )
    epsilon_high: float | None = Field(
        None, gt=0.0, le=10.0, description="Upper clip (DAPO: 0.28; None: epsilon)."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantage = reward - its group's mean, divided by the std of the group's "
        "rewards (group), of all the step's rewards (batch), or not at all (none); the std is "
        "the sample std (n - 1), plus 1e-4. TRL's true and false mean group and none.",
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        "grpo",
        description="Aggregation of the token losses over the step: grpo (each response's "
        "token mean, averaged over responses), dapo (token sum / the step's token count), "
        "dr_grpo (token sum / (responses x max_new_tokens)), bnpo (each micro-batch's token "
        "mean, weighted by its share of the responses: it depends on micro_batch_size).",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        le=64,
        description="Optimizer steps on each step's batch (TRL's mu): the first at the "
        "sampling policy, each later one on the same responses with the ratio to the rollout's "
        "logprobs, clipped by epsilon.",
    )
    micro_batch_size: int = Field(32, ge=1, le=65536, description="Sequences per backward pass.")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        le=1 << 24,
        description="Cut micro-batches by tokens (prompt + response; a longer sequence makes "
        "one alone) instead of by micro_batch_size, each packed into one row without padding. "
        "None: micro_batch_size sequences, padded.",
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=1,
        le=1 << 20,
        description="Response tokens whose logits the trainer computes at once (recomputed "
        "in the backward pass when there are more): bounds the [tokens x vocab] memory.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead "
        "of keeping them (less memory for long responses, ~1/3 more compute).",
    )
    torch_compile: bool = Field(
        False,
        description="torch.compile each decoder layer of the trainer's model (one graph "
        "serves them all: fused norms and activations, fewer kernel launches; the first "
        "passes pay the compile, and a new micro-batch shape may recompile once).",
    )
    train_precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Trainer compute: bfloat16 autocast over float32 weights and optimizer "
        "state, or float32; auto: bfloat16 on GPU, float32 on CPU.",
    )
    weight_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of published weights; auto: bfloat16 on GPU, else float32."
    )
    migration: bool = Field(
        True,
        description="Continue a preempted response from its collected tokens (False: restart it).",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=8,
        description="Asynchronous RL with bounded staleness k: the prompts of steps s+1..s+k "
        "are generated while step s trains, each token by a version >= its step - k (0: "
        "synchronous, on-policy). Stale tokens take the decoupled PPO loss (behaviour_cap).",
    )
    behaviour_cap: float = Field(
        2.0,
        gt=0.0,
        le=1e6,
        description="Truncation of a stale token's importance weight pi_prox / pi_behaviour "
        "in the decoupled PPO loss (max_staleness >= 1; no effect at 0).",
    )
    coordinator_shards: int = Field(
        1,
        ge=1,
        le=MAX_COORDINATOR_SHARDS,
        description="Coordinator processes that collect the run's token deltas, each the groups "
        "of its share of every step's prompts (prompt index mod shards), with its own deltas "
        "stream and durable request table; the first also schedules. Fixed for the run.",
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

    @field_validator("model", "task_path", "dataset")
    @classmethod
    def _no_nul_in_paths(cls, value: str | None) -> str | None:
        if value is not None and "\x00" in value:
            raise ValueError("a path cannot contain a NUL character")
        return value

    @model_validator(mode="after")
    def _check_schedule(self) -> "RunSpec":
        if self.lr_scheduler_type == "constant" and self.warmup_steps > 0:
            raise ValueError(
                "lr_scheduler_type 'constant' has no warmup (as in transformers): use "
                "'constant_with_warmup' with warmup_steps"
            )
        return self

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_rewards_as_trl(cls, value: object) -> object:
        """TRL still takes its old booleans: True is "group", False is "none"."""
        if isinstance(value, bool):
            return "group" if value else "none"
        return value

    @field_validator("reward")
    @classmethod
    def _reward_is_built_in_or_a_function(cls, value: str) -> str:
        if value in BUILTIN_REWARDS or USER_REWARD.fullmatch(value):
            return value
        raise ValueError(
            f"reward must be one of {', '.join(BUILTIN_REWARDS)}, or module.path:function"
        )

    @field_validator("answer_regex")
    @classmethod
    def _regex_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc.msg}") from None
        return value

    @field_validator("prompt_template")
    @classmethod
    def _template_names_fields(cls, value: str | None) -> str | None:
        if value is not None:
            template_fields(value)
        return value

    @model_validator(mode="after")
    def _check_task_path(self) -> "RunSpec":
        if self.task_path is not None and self.task != "math":
            raise ValueError("task_path is only used by the math task")
        if self.dataset is not None:
            if "task" in self.model_fields_set and self.task != "dataset":
                raise ValueError(f"dataset is not used by the built-in task {self.task!r}")
            self.task = "dataset"
        elif self.task == "dataset":
            raise ValueError("task 'dataset' needs a dataset")
        else:  # a built-in task has its own fields and reward
            fields = type(self).model_fields
            for name in DATASET_FIELDS:
                if getattr(self, name) != fields[name].default:
                    raise ValueError(
                        f"{name} is only used with a dataset (task {self.task!r} has its own)"
                    )
        if self.reward == "regex_match" and self.answer_regex is None:
            raise ValueError("reward regex_match needs answer_regex")
        if self.answer_regex is not None and self.reward != "regex_match":
            raise ValueError("answer_regex is only used by reward regex_match")
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("system_prompt is only used with chat_template")
        return self

    def reward_module(self) -> str | None:
        """The module a user reward (`module:function`) imports; None for a built-in."""
        return None if self.reward in BUILTIN_REWARDS else self.reward.partition(":")[0]

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

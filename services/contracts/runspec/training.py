"""The run spec's `training` section (the batch each step trains on and how the trainer
computes), its `optimizer` section (AdamW and its learning rate schedule) and its `loss`
section (the GRPO family's clipping, KL and aggregation), named as Hugging Face TRL names them.

Not here: the rule between lr_scheduler_type and warmup_steps (`spec.RunSpec`).
"""

from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from services.contracts.runspec.base import Section


class TrainingSection(Section):
    steps: int = Field(
        20,
        ge=1,
        le=1_000_000,
        description="RL steps: each samples a batch and takes num_iterations optimizer steps "
        "on it.",
    )
    prompts_per_step: int = Field(16, ge=1, le=8192, description="Prompts per RL step (B).")
    group_size: int = Field(8, ge=1, le=256, description="Responses per prompt (n).")
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


class OptimizerSection(Section):
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


class LossSection(Section):
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
    behaviour_cap: float = Field(
        2.0,
        gt=0.0,
        le=1e6,
        description="Truncation of a stale token's importance weight pi_prox / pi_behaviour "
        "in the decoupled PPO loss (max_staleness >= 1; no effect at 0).",
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_rewards_as_trl(cls, value: object) -> object:
        """TRL still takes its old booleans: True is "group", False is "none"."""
        if isinstance(value, bool):
            return "group" if value else "none"
        return value


LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


class LoraSection(Section):
    """LoRA on the policy (peft), named as TRL's `ModelConfig` names it (peft's own names are
    accepted too: r, target_modules). Off by default: every weight is trained."""

    use_peft: bool = Field(
        False,
        description="Train a LoRA adapter (peft) instead of every weight; on when any lora_ "
        "field is given. The KL term's reference is the base with the adapter disabled.",
    )
    lora_r: int = Field(
        16,
        ge=1,
        le=1024,
        validation_alias=AliasChoices("lora_r", "r"),
        description="LoRA rank (peft's r).",
    )
    lora_alpha: int = Field(32, ge=1, le=1 << 16, description="LoRA scaling: alpha / r.")
    lora_dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input while training (0: the trainer's logprobs "
        "are the rollout's, for the same weights).",
    )
    lora_target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        validation_alias=AliasChoices("lora_target_modules", "target_modules"),
        description='Module names the adapter wraps (peft\'s target_modules), or "all-linear": '
        "every linear layer but the output head.",
    )

    @field_validator("lora_target_modules")
    @classmethod
    def _named_modules(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list):
            if not 1 <= len(value) <= 64:
                raise ValueError("lora_target_modules names 1 to 64 modules")
            for name in value:
                if (
                    not name
                    or len(name) > 200
                    or not name.replace("_", "").replace(".", "").isalnum()
                ):
                    raise ValueError(f"not a module name: {name[:40]!r}")
        return value

    @model_validator(mode="after")
    def _on_when_given(self) -> "LoraSection":
        given = [name for name in LORA_FIELDS if name in self.model_fields_set]
        if "use_peft" not in self.model_fields_set:
            self.use_peft = bool(given)
        elif not self.use_peft:
            changed = [n for n in given if getattr(self, n) != LoraSection.model_fields[n].default]
            if changed:
                raise ValueError(f"lora.{changed[0]} is only used with lora.use_peft true")
        return self

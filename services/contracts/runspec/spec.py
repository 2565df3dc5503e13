"""The run spec: what a user submits (REST or CLI) and what every service reads back.

`RunSpec` is a name, a model and a seed, then one section per concern (`data`, `scoring`,
`sampling`, `training`, `optimizer`, `loss`, `rollout`, `faults`), each a model of its own that
refuses unknown fields. The sectioned form is the canonical one: what `model_dump` gives, what
the REST API shows and what is stored. The flat form (`{"model": ..., "steps": 3,
"temperature": 0.7}`, the form of the CLI flags, TOML files and specs stored before sections)
is still taken: each known field name moves into its section before validation.

Validation lives here, so the API and the CLI reject the same things, naming each field by its
place (`sampling.temperature`). Rules within one field are its section's; rules between fields
are the spec's (below).
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from services.contracts.runspec.data import DataSection, ScoringSection
from services.contracts.runspec.episode import EpisodeSection
from services.contracts.runspec.rollout import FaultsSection, RolloutSection
from services.contracts.runspec.task_files import (
    MAX_PATH_CHARS,
    check_model_folder,
    check_text_file,
    no_nul,
)
from services.contracts.runspec.training import (
    LoraSection,
    LossSection,
    OptimizerSection,
    TrainingSection,
)
from services.contracts.sampling import SamplingParams

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


class RunSpec(BaseModel):
    # JSON has no NaN or Infinity: a spec with them is refused, never stored
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field("", max_length=200, description="Free text shown in listings.")
    model: str = Field(
        min_length=1,
        max_length=MAX_PATH_CHARS,
        description="Local Hugging Face model folder to train.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of prompts and sampling.")
    data: DataSection = Field(
        default_factory=DataSection, description="Where prompts come from, how they are shown."
    )
    scoring: ScoringSection = Field(
        default_factory=ScoringSection, description="How a dataset run's responses are rewarded."
    )
    sampling: SamplingParams = Field(
        default_factory=SamplingParams, description="How responses are sampled."
    )
    training: TrainingSection = Field(
        default_factory=TrainingSection, description="Each step's batch, the trainer's compute."
    )
    optimizer: OptimizerSection = Field(
        default_factory=OptimizerSection, description="AdamW and its learning rate schedule."
    )
    loss: LossSection = Field(
        default_factory=LossSection, description="Clipping, KL and aggregation of the loss."
    )
    rollout: RolloutSection = Field(
        default_factory=RolloutSection, description="How the coordinator collects responses."
    )
    faults: FaultsSection = Field(
        default_factory=FaultsSection, description="Stalled runs and poison requests."
    )
    episode: EpisodeSection = Field(
        default_factory=EpisodeSection,
        description="Multi-turn episodes with an environment (none: single-turn responses).",
    )
    lora: LoraSection = Field(
        default_factory=LoraSection,
        description="LoRA on the policy (peft): an adapter trained instead of every weight.",
    )

    @model_validator(mode="before")
    @classmethod
    def _sections_from_flat(cls, value: Any) -> Any:
        return sectioned(value) if isinstance(value, dict) else value

    @field_validator("model")
    @classmethod
    def _no_nul_in_model(cls, value: str) -> str:
        no_nul(value)
        return value

    @model_validator(mode="after")
    def _check_schedule(self) -> "RunSpec":
        if self.optimizer.lr_scheduler_type == "constant" and self.optimizer.warmup_steps > 0:
            raise ValueError(
                "optimizer.lr_scheduler_type 'constant' has no warmup (as in transformers): "
                "use 'constant_with_warmup' with optimizer.warmup_steps"
            )
        return self

    @model_validator(mode="after")
    def _check_task(self) -> "RunSpec":
        data = self.data
        if data.task_path is not None and data.task != "math":
            raise ValueError("data.task_path is only used by the math task")
        if data.dataset is not None:
            if "task" in data.model_fields_set and data.task != "dataset":
                raise ValueError(f"data.dataset is not used by the built-in task {data.task!r}")
            data.task = "dataset"
        elif data.task == "dataset":
            raise ValueError("data.task 'dataset' needs a data.dataset")
        else:  # a built-in task has its own fields and reward
            for name in DATASET_FIELDS:
                section = SECTION_OF[name]
                if getattr(getattr(self, section), name) != FLAT_FIELDS[name].default:
                    raise ValueError(
                        f"{section}.{name} is only used with a dataset "
                        f"(task {data.task!r} has its own)"
                    )
        return self

    @model_validator(mode="after")
    def _check_pairs(self) -> "RunSpec":
        scoring = self.scoring
        if scoring.reward == "regex_match" and scoring.answer_regex is None:
            raise ValueError("scoring.reward regex_match needs scoring.answer_regex")
        if scoring.answer_regex is not None and scoring.reward != "regex_match":
            raise ValueError("scoring.answer_regex is only used by scoring.reward regex_match")
        if self.data.system_prompt is not None and not self.data.chat_template:
            raise ValueError("data.system_prompt is only used with data.chat_template")
        if self.episode.environment is not None:
            defaults = ScoringSection().model_dump()
            given = self.scoring.model_dump()
            changed = [k for k in given if k != "reward_timeout_s" and given[k] != defaults[k]]
            if changed:
                raise ValueError(
                    f"scoring.{changed[0]} is not used with episode.environment: the "
                    "environment rewards each turn"
                )
        return self

    def flat(self) -> dict[str, Any]:
        """Every field by its own name, sections undone: the form of the CLI flags."""
        return {
            name: getattr(getattr(self, SECTION_OF[name]), name)
            if name in SECTION_OF
            else getattr(self, name)
            for name in FLAT_FIELDS
        }

    def check_task_file(self, max_bytes: int) -> None:
        """Raise TaskFileError unless `data.task_path` (when given) is a readable UTF-8 file of
        at most `max_bytes` bytes."""
        if self.data.task_path is not None:
            check_text_file(self.data.task_path, max_bytes)

    def check_model_folder(self) -> None:
        """Raise ModelFolderError unless `model` is a readable model folder with room for a
        prompt beside `sampling.max_new_tokens`."""
        check_model_folder(self.model, self.sampling.max_new_tokens)


def section_fields(annotation: Any) -> dict[str, FieldInfo]:
    """The fields of a section (a field's type that is a pydantic model or pydantic dataclass)
    by name; none for a field that is not a section."""
    fields = (
        getattr(annotation, "__pydantic_fields__", None) if isinstance(annotation, type) else None
    )
    return dict(fields) if isinstance(fields, dict) else {}


def names_of(field: str, info: FieldInfo) -> tuple[str, ...]:
    """A field's name and its old names (`beta`, `kl_coef`)."""
    alias = info.validation_alias
    olds = alias.choices if isinstance(alias, AliasChoices) else []
    return (field, *(name for name in olds if isinstance(name, str) and name != field))


# The one table of sections, read from RunSpec's fields: section -> its fields.
_SECTION_FIELDS: dict[str, dict[str, FieldInfo]] = {
    section: fields
    for section, info in RunSpec.model_fields.items()
    if (fields := section_fields(info.annotation))
}
SECTIONS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {section: tuple(fields) for section, fields in _SECTION_FIELDS.items()}
)
SECTION_OF: Mapping[str, str] = MappingProxyType(
    {field: section for section, fields in SECTIONS.items() for field in fields}
)
# Every field by its own name, top-level ones first, then each section's in order.
FLAT_FIELDS: Mapping[str, FieldInfo] = MappingProxyType(
    {name: info for name, info in RunSpec.model_fields.items() if name not in SECTIONS}
    | {field: info for fields in _SECTION_FIELDS.values() for field, info in fields.items()}
)


def place_of(field: str) -> tuple[str, ...]:
    """Where a field is in the sectioned spec: ("sampling", "temperature"), ("model",)."""
    return (SECTION_OF[field], field) if field in SECTION_OF else (field,)


# Every name a flat spec may give a section's field by (old names too) -> all names of it.
_NAMES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        name: names
        for field in SECTION_OF
        for names in [names_of(field, FLAT_FIELDS[field])]
        for name in names
    }
)


def sectioned(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each flat field name (and old name) moved into its section; ValueError
    where a field is given twice, flat and in its section (or by two of its names)."""
    out = {name: value for name, value in values.items() if name not in _NAMES}
    copied: set[str] = set()
    for name, value in values.items():
        if name not in _NAMES:
            continue
        field = _NAMES[name][0]
        section = SECTION_OF[field]
        given = out.get(section, {})
        if not isinstance(given, dict):
            raise ValueError(f"{name} is given flat beside a whole {section} section: move it in")
        if section not in copied:
            given = out[section] = dict(given)
            copied.add(section)
        inside = values.get(section, {})
        for other in _NAMES[name]:
            if other in given:
                where = f"{section}.{other}" if other in inside else other
                raise ValueError(f"{section}.{field} is given twice: as {name} and as {where}")
        given[name] = value
    return out


# The embedded default run (`spotrl up`, `make up`): its choices where they differ from a spec's
# own defaults above, in one place, by flat field name. With them the small arithmetic model that
# `spotrl init-model` builds climbs from about 0.35 to 0.55 reward in 40 steps of 32 prompts x 8
# responses of at most 6 tokens (under a minute of RL on 2 CPU cores; README), and a run stalled
# for 5 minutes fails rather than waits for ever. A spec submitted over REST or as TOML gets
# RunSpec's defaults; `spotrl up` applies this preset on top of them, and each of its flags
# overrides both.
EMBEDDED_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "steps": 40,
        "prompts_per_step": 32,
        "max_new_tokens": 6,
        "stall_timeout_s": 300.0,
    }
)
# `spotrl up --task NAME`: the embedded preset with these on top, for the flags not given.
# long_addition: a step of 16 prompts x 8 responses of up to 420 tokens (its longest scratchpad
# ~410), so rollout is most of the step (94% on 2 cores); 40 steps take 640 prompts, 3.3 passes
# over the task's pool of 192 (its POOL_SIZE), each prompt coming back every 12 steps.
# countdown: 16 prompts x 8 responses of up to 300 tokens (its longest count, from 99, ~290),
# 40 steps taking 5 passes over its pool of 128, each prompt coming back every 8 steps.
TASK_PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "long_addition": MappingProxyType(
            {
                "steps": 40,
                "prompts_per_step": 16,
                "group_size": 8,
                "max_new_tokens": 420,
                "learning_rate": 3e-4,
            }
        ),
        "countdown": MappingProxyType(
            {
                "steps": 40,
                "prompts_per_step": 16,
                "group_size": 8,
                "max_new_tokens": 300,
            }
        ),
    }
)
# Pre-training steps of the base model that `spotrl up` and `spotrl init-model` build when no
# model folder is named (about two minutes on 2 CPU cores).
EMBEDDED_PRETRAIN_STEPS = 1000

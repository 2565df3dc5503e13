"""The run spec's `data` section (where prompts come from and how they are shown to the model)
and its `scoring` section (how a response is rewarded).

Rules between these fields and other sections' (a built-in task refuses the dataset fields, a
regex reward needs its pattern) are the spec's: `spec.RunSpec`.
"""

import re
from typing import Literal

from pydantic import Field, field_validator

from services.contracts.runspec.base import Section
from services.contracts.runspec.task_files import (
    MAX_PATH_CHARS,
    MAX_TEXT_CHARS,
    no_nul,
    template_fields,
)

# The rewards a spec names without code; the functions are in services/tasks/rewards.py.
BUILTIN_REWARDS = ("exact_match", "numeric_match", "regex_match", "boxed_match")
# A user reward: `module.path:function`, importable where the coordinator runs.
USER_REWARD = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)


class DataSection(Section):
    task: Literal["arithmetic", "long_addition", "countdown", "math", "dataset"] = Field(
        "arithmetic",
        description="Where prompts and rewards come from: a built-in (arithmetic: generated "
        "sums, exact match; long_addition: sums of 2 to 12 digits with a written scratchpad, "
        "responses of ~20 to ~300 tokens, exact match of the whole scratchpad; countdown: "
        "`47:` -> `47,46,...,0;`, responses of ~10 to ~290 tokens, exact match; math: GSM8K "
        "rows, their final number checked by math_verify) "
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

    @field_validator("task_path", "dataset")
    @classmethod
    def _no_nul_in_paths(cls, value: str | None) -> str | None:
        return no_nul(value)

    @field_validator("prompt_template")
    @classmethod
    def _template_names_fields(cls, value: str | None) -> str | None:
        if value is not None:
            template_fields(value)
        return value


class ScoringSection(Section):
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

    def reward_module(self) -> str | None:
        """The module a user reward (`module:function`) imports; None for a built-in."""
        return None if self.reward in BUILTIN_REWARDS else self.reward.partition(":")[0]

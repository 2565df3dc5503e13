"""The run spec's `episode` section: multi-turn (agentic) rollouts. With an `environment`, each
response is an episode of model turns and the environment's observations (tool results,
feedback) between them, of at most `max_turns` turns and `sampling.max_new_tokens` tokens in all
(observations included); the environment rewards each turn and the episode's reward is their sum
(docs/environments.md). Without one (the default), a response is one turn, scored by the
`scoring` section's reward.
"""

import re
from typing import Literal

from pydantic import Field, field_validator

from services.contracts.runspec.base import Section

# The environments a spec names without code (services/environments/builtin.py).
BUILTIN_ENVIRONMENTS = ("retry_arithmetic", "calculator")
# A user's environment: `module.path:Class`, from the coordinator's environment_modules.
USER_ENVIRONMENT = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)
ToolFormat = Literal["hermes", "llama3_json", "mistral", "none"]


class EpisodeSection(Section):
    environment: str | None = Field(
        None,
        min_length=1,
        max_length=400,
        description="Multi-turn episodes with this environment: a built-in (retry_arithmetic: "
        "the sum asked again after a wrong answer; calculator: add and multiply tools) or "
        "module:Class from a module on the coordinator's environment_modules allow list "
        "(None: single-turn responses).",
    )
    max_turns: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Model turns an episode takes at most (with environment). None: the "
        "environment's own max_turns; set, it overrides the environment's, above or below it.",
    )
    tool_format: ToolFormat = Field(
        "hermes",
        description="How tool calls are parsed from a model turn: hermes (<tool_call> JSON, "
        "Qwen and Hermes models), llama3_json, mistral ([TOOL_CALLS]) or none.",
    )
    environment_timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=600.0,
        description="A call of the environment that takes longer ends its episode with the "
        "rewards so far and is counted (environment_errors).",
    )

    @field_validator("environment")
    @classmethod
    def _built_in_or_a_class(cls, value: str | None) -> str | None:
        if value is None or value in BUILTIN_ENVIRONMENTS or USER_ENVIRONMENT.fullmatch(value):
            return value
        raise ValueError(
            f"environment must be one of {', '.join(BUILTIN_ENVIRONMENTS)}, or module.path:Class"
        )

    def environment_module(self) -> str | None:
        """The module a user's environment (`module:Class`) imports; None for a built-in."""
        env = self.environment
        return None if env is None or env in BUILTIN_ENVIRONMENTS else env.partition(":")[0]

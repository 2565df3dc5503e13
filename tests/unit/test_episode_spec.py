"""The run spec's `episode` section (issue 40): an environment by name, its limits, the flat
form and the CLI flags; the names the spec accepts are the environments and tool-call formats
that exist."""

from typing import get_args

import pytest
from pydantic import ValidationError

from services.contracts.runspec import BUILTIN_ENVIRONMENTS, RunSpec, ToolFormat
from services.environments import builtin, tool_calls


def test_flat_and_sectioned_forms_agree_and_single_turn_is_the_default():
    flat = RunSpec(model="m", environment="retry_arithmetic", max_turns=4, tool_format="none")
    sectioned = RunSpec.model_validate(
        {
            "model": "m",
            "episode": {"environment": "retry_arithmetic", "max_turns": 4, "tool_format": "none"},
        }
    )
    assert flat == sectioned and flat.episode.environment_module() is None
    assert RunSpec(model="m").episode.environment is None
    user = RunSpec(model="m", environment="my_envs.games:Wordle")
    assert user.episode.environment_module() == "my_envs.games"


def test_bad_episodes_are_refused_by_their_place():
    def refused(**fields) -> str:
        with pytest.raises(ValidationError) as err:
            RunSpec(model="m", **fields)
        return str(err.value)

    assert "episode.environment" in refused(environment="not a class")
    assert "episode.max_turns" in refused(environment="calculator", max_turns=0)
    assert "episode.tool_format" in refused(tool_format="xml")
    message = refused(
        environment="calculator", task="dataset", dataset="d.jsonl", reward="numeric_match"
    )
    assert "scoring.reward is not used with episode.environment" in message


def test_the_spec_names_the_environments_and_formats_that_exist():
    assert set(BUILTIN_ENVIRONMENTS) == set(builtin.BUILTIN_ENVIRONMENTS)
    assert set(get_args(ToolFormat)) == set(tool_calls.TOOL_CALL_FORMATS)


def test_a_stored_episode_spec_reads_back_as_it_was():
    spec = RunSpec(model="m", environment="retry_arithmetic", max_new_tokens=40)
    assert RunSpec.model_validate_json(spec.model_dump_json()) == spec

"""One source of defaults: `spotrl up`'s run flags come from RunSpec (names, help, choices,
bounds; one flag per field of every section, named by the field alone, as before sections) with
the embedded preset on top, and the settings a local deployment gives each service
are rendered from that service's settings class."""

from pathlib import Path

import pytest

from services.cli.main import build_parser, main
from services.cli.spec_flags import NOT_FLAGS, flag, spec_from_args
from services.contracts.runspec import EMBEDDED_DEFAULTS, FLAT_FIELDS, TASK_PRESETS, RunSpec
from services.infra.settings import CommonSettings, env_name, settings_env
from services.rollout.settings import RolloutSettings


def up_args(*argv: str):
    return build_parser().parse_args(["up", *argv])


def test_every_run_spec_field_is_a_flag_of_up_with_its_description(capsys):
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # help text is wrapped
    for name, info in FLAT_FIELDS.items():
        if name in NOT_FLAGS:
            continue
        assert hasattr(up_args(), name), name
        assert flag(name) in shown, name
        assert info.description and " ".join(info.description.split()) in shown, name
    assert "EMBEDDED_DEFAULTS: steps=40" in shown


def test_up_runs_the_embedded_preset_by_default():
    spec = spec_from_args(up_args(), model="/m")
    assert spec == RunSpec(model="/m", **EMBEDDED_DEFAULTS)
    # the run `spotrl up` has always made: 40 steps of 32 prompts x 8 responses of 6 tokens
    training, sampling = spec.training, spec.sampling
    assert (training.steps, training.prompts_per_step, training.group_size) == (40, 32, 8)
    assert (sampling.max_new_tokens, sampling.temperature) == (6, 1.0)
    assert (spec.optimizer.learning_rate, spec.seed, spec.faults.stall_timeout_s) == (
        1e-4,
        0,
        300.0,
    )


def test_the_preset_names_run_spec_fields_with_valid_values():
    assert set(EMBEDDED_DEFAULTS) <= set(FLAT_FIELDS)
    RunSpec(model="/m", **EMBEDDED_DEFAULTS)


def test_flags_take_types_choices_and_switches_from_the_spec():
    spec = spec_from_args(
        up_args(
            "--micro-batch-size",
            "4",
            "--beta",
            "0.05",
            "--epsilon",
            "0.1",
            "--top-p",
            "0.9",
            "--weight-dtype",
            "bfloat16",
            "--no-migration",
            "--ignore-eos",
            "--on-poison",
            "fail_run",
            "--task",
            "math",
            "--task-path",
            "q.jsonl",
        ),
        model="/m",
    )
    assert (
        spec.training.micro_batch_size,
        spec.loss.beta,
        spec.loss.epsilon,
        spec.sampling.top_p,
    ) == (4, 0.05, 0.1, 0.9)
    assert (spec.training.weight_dtype, spec.rollout.migration, spec.sampling.ignore_eos) == (
        "bfloat16",
        False,
        True,
    )
    assert (spec.faults.on_poison, spec.data.task, spec.data.task_path) == (
        "fail_run",
        "math",
        "q.jsonl",
    )
    with pytest.raises(SystemExit):
        up_args("--weight-dtype", "int8")  # not one of the Literal's choices


def test_stall_timeout_zero_or_none_waits_for_ever():
    def stall_timeout_s(value: str) -> float | None:
        return spec_from_args(
            up_args("--stall-timeout-s", value), model="/m"
        ).faults.stall_timeout_s

    assert stall_timeout_s("0") is None
    assert stall_timeout_s("none") is None
    assert stall_timeout_s("30") == 30.0


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--prompts-per-step", "0"], "--prompts-per-step (training.prompts_per_step)"),
        (["--top-p", "1.5"], "--top-p (sampling.top_p)"),
        (["--stall-timeout-s", "-1"], "--stall-timeout-s (faults.stall_timeout_s)"),
        (["--task-path", "q.jsonl"], "task_path is only used by the math task"),
    ],
)
def test_up_refuses_what_the_spec_refuses_naming_the_flag(argv, named, capsys, tmp_path):
    assert main(["up", "--model", str(tmp_path / "m"), *argv]) == 2
    err = capsys.readouterr().err
    assert "invalid run options" in err and named in err
    assert not any(tmp_path.iterdir())  # nothing was started or built


def test_settings_env_is_named_by_the_settings_class(monkeypatch):
    env = settings_env(
        RolloutSettings,
        slots=16,
        pool="reserved",
        cache_dir=Path("/tmp/x"),
        vllm_enforce_eager=True,
        api_token=None,  # None: left out (the default stays)
    )
    assert env == {
        "SPOTRL_SLOTS": "16",
        "SPOTRL_POOL": "reserved",
        "SPOTRL_CACHE_DIR": "/tmp/x",
        "SPOTRL_VLLM_ENFORCE_EAGER": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    read = RolloutSettings()
    assert (read.slots, read.pool, read.cache_dir, read.vllm_enforce_eager) == (
        16,
        "reserved",
        Path("/tmp/x"),
        True,
    )
    assert env_name(CommonSettings, "api_token") == "SPOTRL_API_TOKEN"
    with pytest.raises(KeyError, match="RolloutSettings has no setting 'slot'"):
        settings_env(RolloutSettings, slot=1)


def test_a_task_preset_fills_the_flags_not_given():
    """`spotrl up --task long_addition` runs that task's preset over the embedded one; a flag
    given wins, and another task keeps the embedded preset."""
    preset = TASK_PRESETS["long_addition"]
    spec = spec_from_args(up_args("--task", "long_addition"), model="/m")
    assert spec == RunSpec(model="/m", **(EMBEDDED_DEFAULTS | preset | {"task": "long_addition"}))
    # the longest scratchpad fits, and the first and the last 10 steps do not overlap
    assert spec.sampling.max_new_tokens >= 400 and spec.training.steps >= 30
    given = spec_from_args(up_args("--task", "long_addition", "--steps", "5"), model="/m")
    assert (given.training.steps, given.training.group_size) == (5, preset["group_size"])
    math = spec_from_args(up_args("--task", "math", "--task-path", "q.jsonl"), model="/m")
    assert (math.training.steps, math.sampling.max_new_tokens) == (40, 6)


def test_the_long_task_preset_sees_each_prompt_of_its_pool_three_times():
    """History-based speculation drafts from earlier responses to the same prompt: the
    preset's run passes over the task's pool at least 3 times."""
    from services.tasks.long_addition import POOL_SIZE

    preset = TASK_PRESETS["long_addition"]
    assert preset["steps"] * preset["prompts_per_step"] >= 3 * POOL_SIZE


def test_task_presets_name_run_spec_fields_with_valid_values(capsys):
    for task, preset in TASK_PRESETS.items():
        assert set(preset) <= set(FLAT_FIELDS) - NOT_FLAGS
        RunSpec(model="/m", task=task, **(EMBEDDED_DEFAULTS | preset))
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "with --task: long_addition 40" in shown


def test_lora_flags_turn_lora_on_and_their_defaults_do_not():
    off = spec_from_args(up_args(), model="m")
    assert not off.lora.use_peft
    on = spec_from_args(up_args("--lora-r", "8"), model="m")
    assert on.lora.use_peft and on.lora.lora_r == 8
    named = spec_from_args(up_args("--lora-target-modules", "q_proj, v_proj"), model="m")
    assert named.lora.lora_target_modules == ["q_proj", "v_proj"]
    every = spec_from_args(up_args("--use-peft"), model="m")
    assert every.lora.use_peft and every.lora.lora_target_modules == "all-linear"

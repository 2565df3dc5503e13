"""The run spec in sections: the sectioned form is canonical, the flat form is still taken (and
means the same), a field given both ways or unknown is refused naming its place, every field is
in exactly one section, and one `SamplingParams` is what the spec, the job and its msgpack
encoding carry."""

import json

import msgspec
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from services.contracts.messages import Job, MalformedMessage
from services.contracts.records import RunRecord
from services.contracts.runspec import (
    EMBEDDED_DEFAULTS,
    FLAT_FIELDS,
    SECTION_OF,
    SECTIONS,
    RunSpec,
    place_of,
)
from services.contracts.sampling import SamplingParams
from services.coordinator.api.routes import runs_router
from services.coordinator.settings import CoordinatorSettings
from services.infra.http_limits import guard_input
from services.infra.service import Auth
from tests import factories

FLAT = {
    "model": "/m",
    "seed": 3,
    "dataset": "d.jsonl",
    "reward": "regex_match",
    "answer_regex": r"(\d+)",
    "temperature": 0.7,
    "top_k": 20,
    "steps": 5,
    "learning_rate": 3e-4,
    "kl_coef": 0.05,  # an old name: loss.beta
    "clip_range": 0.3,  # an old name: loss.epsilon
    "max_staleness": 1,
    "on_poison": "fail_run",
}
SECTIONED = {
    "model": "/m",
    "seed": 3,
    "data": {"dataset": "d.jsonl"},
    "scoring": {"reward": "regex_match", "answer_regex": r"(\d+)"},
    "sampling": {"temperature": 0.7, "top_k": 20},
    "training": {"steps": 5},
    "optimizer": {"learning_rate": 3e-4},
    "loss": {"beta": 0.05, "epsilon": 0.3},
    "rollout": {"max_staleness": 1},
    "faults": {"on_poison": "fail_run"},
}


def errors(**fields) -> list[tuple[tuple, str]]:
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate({"model": "/m", **fields})
    return [(e["loc"], e["msg"]) for e in caught.value.errors()]


def test_the_flat_form_means_the_sectioned_form():
    flat, sectioned = RunSpec.model_validate(FLAT), RunSpec.model_validate(SECTIONED)
    assert flat == sectioned
    assert flat.data.task == "dataset" and flat.loss.beta == 0.05 and flat.loss.epsilon == 0.3
    # a mix of both, and the sections' own old names, mean the same too
    mixed = {**SECTIONED, "sampling": {"temperature": 0.7}, "top_k": 20}
    mixed["loss"] = {"kl_coef": 0.05, "clip_range": 0.3}
    assert RunSpec.model_validate(mixed) == sectioned
    assert RunSpec(model="/m", **EMBEDDED_DEFAULTS).training.steps == 40


def test_the_sectioned_form_is_what_is_dumped_and_stored_and_a_flat_stored_spec_still_reads():
    spec = RunSpec.model_validate(FLAT)
    dumped = spec.model_dump()
    assert set(dumped) == {"name", "model", "seed", *SECTIONS}
    assert dumped["sampling"]["temperature"] == 0.7 and dumped["loss"]["beta"] == 0.05
    assert RunSpec.model_validate_json(spec.model_dump_json()) == spec
    # a run stored before sections: its flat JSON text parses to the same spec
    old = RunRecord(id="r", spec=json.dumps(FLAT), state="queued", created_at=1.0)
    assert old.run_spec() == spec
    assert spec.flat()["temperature"] == 0.7 and set(spec.flat()) == set(FLAT_FIELDS)


def test_a_field_given_flat_and_in_its_section_is_refused():
    (only,) = errors(temperature=0.5, sampling={"temperature": 0.6})
    assert only == ((), "Value error, sampling.temperature is given twice: as temperature and "
                    "as sampling.temperature")  # fmt: skip
    assert "loss.beta is given twice" in errors(kl_coef=0.1, loss={"beta": 0.2})[0][1]
    assert "loss.beta is given twice" in errors(kl_coef=0.1, beta=0.2)[0][1]
    assert (
        "given flat beside a whole sampling section"
        in errors(top_k=3, sampling=SamplingParams(temperature=0.5))[0][1]
    )


def test_unknown_and_misplaced_fields_are_refused_by_their_place():
    assert errors(tempreature=1.0) == [(("tempreature",), "Extra inputs are not permitted")]
    assert errors(sampling={"steps": 3})[0][0] == ("sampling", "steps")
    assert errors(training={"temperature": 1.0})[0][0] == ("training", "temperature")
    assert errors(sampling={"temperature": 11})[0][0] == ("sampling", "temperature")
    assert errors(temperature=11)[0][0] == ("sampling", "temperature")  # flat: its place too
    assert errors(temperature=float("nan"))[0][0] == ("sampling", "temperature")
    # a rule between fields names them by their place
    assert "data.task_path is only used by the math task" in errors(task_path="q.jsonl")[0][1]
    assert "optimizer.warmup_steps" in errors(warmup_steps=3)[0][1]


def test_every_field_is_in_exactly_one_section():
    wanted = {
        "data": (
            *("task", "task_path", "dataset", "dataset_split", "prompt_field", "answer_field"),
            *("prompt_template", "chat_template", "system_prompt", "shuffle"),
        ),
        "scoring": ("reward", "answer_regex", "reward_tolerance", "reward_timeout_s"),
        "sampling": (
            *("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty"),
            "ignore_eos",
        ),
        "training": (
            *("steps", "prompts_per_step", "group_size", "num_iterations", "micro_batch_size"),
            *("max_tokens_per_micro_batch", "logprob_chunk_tokens", "gradient_checkpointing"),
            *("torch_compile", "train_precision", "weight_dtype"),
        ),
        "optimizer": (
            *("learning_rate", "adam_beta1", "adam_beta2", "weight_decay", "lr_scheduler_type"),
            *("warmup_steps", "max_grad_norm"),
        ),
        "loss": ("beta", "epsilon", "epsilon_high", "scale_rewards", "loss_type", "behaviour_cap"),
        "rollout": (
            *("migration", "max_staleness", "coordinator_shards", "share", "fair_reads"),
            *("seeding_wait_share", "seeding_backoff", "pool_headroom"),
            *("drafts", "length_aware"),
        ),
        "faults": ("stall_timeout_s", "max_request_crashes", "on_poison", "max_error_share"),
        "episode": ("environment", "max_turns", "tool_format", "environment_timeout_s"),
        "lora": ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"),
    }
    assert wanted == SECTIONS
    every = [field for fields in SECTIONS.values() for field in fields]
    # the 57 fields of the flat spec but name, model and seed; the 4 of multi-turn episodes;
    # faults.max_error_share; rollout.drafts and rollout.length_aware (issue 50); the 5 of lora;
    # rollout.share (issue 52)
    assert len(every) == len(set(every)) == len(SECTION_OF) == 57 - 3 + 4 + 1 + 2 + 5 + 1
    assert set(FLAT_FIELDS) == {"name", "model", "seed", *every}
    assert place_of("top_p") == ("sampling", "top_p") and place_of("model") == ("model",)
    assert RunSpec.model_json_schema()["additionalProperties"] is False


def test_a_422_names_the_place_of_the_field():
    settings = CoordinatorSettings(api_token=None)
    app = FastAPI()
    guard_input(app, None, settings.max_body_bytes)
    app.include_router(runs_router(None, None, Auth(), settings))  # type: ignore[arg-type]
    with TestClient(app) as client:
        for body in (
            {"model": "/m", "sampling": {"temperature": 11}},
            {"model": "/m", "temperature": 11},  # flat, named by its place as well
        ):
            resp = client.post("/v1/runs", json=body)
            assert resp.status_code == 422, resp.text
            (error,) = resp.json()["detail"]
            assert error["loc"] == ["body", "sampling", "temperature"], error
        resp = client.post("/v1/runs", json={"model": "/m", "sampling": {"tempreature": 1}})
        assert resp.json()["detail"][0]["loc"] == ["body", "sampling", "tempreature"]


def test_one_sampling_params_from_the_spec_through_the_job_and_its_encoding():
    spec = RunSpec.model_validate(FLAT)
    table = factories.table(1, 2, run_id="r", stops=(), sampling=spec.sampling)
    for job in table.initial_jobs():
        assert job.sampling is spec.sampling
        decoded = Job.decode(job.encode())
        assert decoded == job and type(decoded.sampling) is SamplingParams
        assert decoded.sampling.top_k == 20 and decoded.remaining_tokens == 8
    raw = msgspec.msgpack.decode(next(iter(table.initial_jobs())).encode())
    raw["sampling"]["top_p"] = 1.5  # out of its bounds: refused where decoded
    with pytest.raises(MalformedMessage):
        Job.decode(msgspec.msgpack.encode(raw))


def test_sampling_params_are_validated_by_pydantic_on_their_own():
    with pytest.raises(ValidationError) as caught:
        SamplingParams(temperature=-1.0)
    assert caught.value.errors()[0]["loc"] == ("temperature",)
    with pytest.raises(ValidationError):
        SamplingParams(temprature=1.0)  # type: ignore[call-arg]
    assert SamplingParams().plain and not SamplingParams(top_k=5).plain


def test_the_lora_section_turns_on_when_one_of_its_fields_is_given():
    assert not RunSpec(model="m").lora.use_peft
    spec = RunSpec.model_validate({"model": "m", "lora_r": 8})
    assert spec.lora.use_peft and spec.lora.lora_r == 8
    # peft's own names, in the section
    peft = RunSpec.model_validate({"model": "m", "lora": {"r": 4, "target_modules": ["q_proj"]}})
    assert (peft.lora.use_peft, peft.lora.lora_r, peft.lora.lora_target_modules) == (
        True,
        4,
        ["q_proj"],
    )
    # what is stored reads back the same, on or off
    for stored in (spec, RunSpec(model="m")):
        assert RunSpec.model_validate_json(stored.model_dump_json()).lora == stored.lora
    with pytest.raises(ValidationError, match="only used with lora.use_peft"):
        RunSpec.model_validate({"model": "m", "use_peft": False, "lora_r": 4})
    with pytest.raises(ValidationError, match="not a module name"):
        RunSpec.model_validate({"model": "m", "lora_target_modules": ["q_proj;rm"]})

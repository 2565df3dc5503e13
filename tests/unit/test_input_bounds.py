"""Bounds on untrusted input: error bodies, the token and body-size checks, loopback-only without
a token, run spec limits, task files, the per-step cap, and which keys a finished run drops."""

import json
import os

import pytest
from pydantic import ValidationError

from services.contracts import keys
from services.contracts.runspec import (
    ModelFolderError,
    RunSpec,
    TaskFileError,
    check_text_file,
)
from services.coordinator.api.routes import over_step_caps
from services.coordinator.run.shard import failure_text
from services.infra.http_limits import (
    MAX_ERROR_BODY_BYTES,
    BodyLimits,
    authorized,
    bound_errors,
    clip,
    declared_length,
)
from services.infra.settings import CommonSettings, is_loopback
from services.state.runs import audit_keys, scratch_keys
from services.tasks import TaskError, load_task

SECRET = "s3cret-file-content"


def test_validation_errors_never_echo_the_input_and_stay_small():
    huge = "x" * 1_000_000
    raw = [
        {
            "loc": ("body", huge, i),
            "msg": "Input should be a valid integer " + huge,
            "type": "int_parsing",
            "input": huge,
            "ctx": {"error": ValueError(huge), "le": 10, "bad": float("nan"), "text": huge},
        }
        for i in range(500)
    ]
    out = bound_errors(raw)
    body = json.dumps({"detail": out})
    assert len(body) <= MAX_ERROR_BODY_BYTES
    assert all(set(e) <= {"loc", "msg", "type", "ctx"} for e in out)
    assert out[0]["ctx"]["le"] == 10 and "error" not in out[0]["ctx"]
    assert out[-1]["type"] == "too_many" and "more errors" in out[-1]["msg"]
    assert huge[:1000] not in body


def test_a_few_errors_are_kept_whole():
    raw = [{"loc": ("body", "group_size"), "msg": "bad", "type": "greater_than", "input": 0}]
    assert bound_errors(raw) == [
        {"loc": ["body", "group_size"], "msg": "bad", "type": "greater_than"}
    ]


def test_clip_says_how_much_it_left_out():
    assert clip("abc", 5) == "abc"
    assert clip("a" * 10, 4) == "aaaa... (6 more characters)"


def test_bearer_token_check():
    assert authorized({"authorization": "Bearer tok"}, "tok")
    assert authorized({"authorization": "bearer tok"}, "tok")
    assert not authorized({"authorization": "Bearer nope"}, "tok")
    assert not authorized({"authorization": "tok"}, "tok")
    assert not authorized({}, "tok")


def test_declared_length():
    assert declared_length({}) is None
    assert declared_length({"content-length": "12"}) == 12
    assert declared_length({"content-length": "-1"}) == -1
    assert declared_length({"content-length": "9" * 40}) == -1


def test_body_limits_by_route_template():
    limits = BodyLimits.of(100, {"/v1/models/{model}/versions/{version}/files/{name}": 10**9})
    assert limits.for_path("/v1/models/m/versions/3/files/a.bin") == 10**9
    assert limits.for_path("/v1/models/m/versions/3/commit") == 100
    assert limits.for_path("/v1/runs") == 100


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"])
def test_loopback_addresses(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "example.com", ""])
def test_reachable_addresses(host):
    assert not is_loopback(host)


def test_no_token_off_loopback_is_refused(monkeypatch):
    monkeypatch.delenv("SPOTRL_API_TOKEN", raising=False)
    monkeypatch.setenv("SPOTRL_REDIS_URL", "redis://:hunter2@redis:6379/0")
    with pytest.raises(ValidationError) as caught:
        CommonSettings(host="0.0.0.0")
    assert "SPOTRL_API_TOKEN" in str(caught.value)
    assert "hunter2" not in str(caught.value)  # the input is never printed
    assert CommonSettings(host="0.0.0.0", api_token="t").api_token == "t"
    assert CommonSettings(host="127.0.0.1").api_token is None


def spec(**over) -> dict:
    return {"model": "/models/m"} | over


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": float("nan")},
        {"top_p": float("inf")},
        {"learning_rate": float("-inf")},
        {"stall_timeout_s": float("nan")},
        {"model": "m" * 100_000},
        {"task": "math", "task_path": "p" * 5000},
        {"model": "a\x00b"},
        {"name": "n" * 201},
        {"seed": 10**280},
    ],
)
def test_run_spec_refuses(bad):
    with pytest.raises(ValidationError):
        RunSpec.model_validate(spec(**bad))


def test_run_spec_refuses_nan_in_json():
    with pytest.raises(ValidationError):
        RunSpec.model_validate_json('{"model": "m", "temperature": NaN}')


def test_step_caps():
    big = RunSpec.model_validate(spec(prompts_per_step=8192, group_size=256, max_new_tokens=256))
    problems = over_step_caps(big, 65536, 2**27)
    assert [p["loc"][-1] for p in problems] == ["prompts_per_step", "max_new_tokens"]
    assert "SPOTRL_MAX_STEP_REQUESTS" in problems[0]["msg"]
    assert "2097152" in problems[0]["msg"]
    at_cap = RunSpec.model_validate(spec(prompts_per_step=4096, group_size=16, max_new_tokens=2))
    assert over_step_caps(at_cap, 65536, 2**27) == []
    long = RunSpec.model_validate(spec(prompts_per_step=1024, group_size=16, max_new_tokens=131072))
    assert [p["loc"][-1] for p in over_step_caps(long, 65536, 2**27)] == ["max_new_tokens"]


def test_task_file_checks(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"question": "1+1?", "answer": "2"}\n')
    check_text_file(str(good), 1000)
    with pytest.raises(TaskFileError, match="does not exist"):
        check_text_file(str(tmp_path / "none.jsonl"), 1000)
    with pytest.raises(TaskFileError, match="is a directory"):
        check_text_file(str(tmp_path), 1000)
    with pytest.raises(TaskFileError, match="over the limit of 10 bytes"):
        check_text_file(str(good), 10)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(SECRET.encode() + b"\xff\xfe" + SECRET.encode())
    with pytest.raises(TaskFileError, match="not UTF-8") as caught:
        check_text_file(str(binary), 1000)
    assert SECRET not in str(caught.value)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(TaskFileError, match="not a regular file"):
        check_text_file(str(fifo), 1000)  # refused without opening it (which would block)
    with pytest.raises(TaskFileError, match="cannot be read"):
        check_text_file("/" + "x" * 5000, 1000)


def test_spec_checks_its_task_file(tmp_path):
    s = RunSpec.model_validate(spec(task="math", task_path=str(tmp_path / "none.jsonl")))
    with pytest.raises(TaskFileError):
        s.check_task_file(1000)
    RunSpec.model_validate(spec()).check_task_file(1000)  # no task file: nothing to check


def test_a_model_path_too_long_for_the_file_system_is_a_clear_error():
    s = RunSpec.model_validate(spec(model="/" + "m" * 4000))
    with pytest.raises(ModelFolderError, match="cannot be read: File name too long") as caught:
        s.check_model_folder()
    assert len(str(caught.value)) < 400


def test_the_task_loader_never_shows_file_content(tmp_path):
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(SECRET.encode() + b"\n\xff" + SECRET.encode())
    with pytest.raises(TaskError) as caught:
        load_task("math", str(binary))
    assert SECRET not in str(caught.value) and "not UTF-8" in str(caught.value)
    assert SECRET not in failure_text(caught.value)
    for bad_row in (f'{{"question": 1, "answer": "{SECRET}"}}', f'"{SECRET}"', f"{SECRET} {{"):
        rows = tmp_path / "rows.jsonl"
        rows.write_text(bad_row + "\n")
        with pytest.raises(TaskError, match="rows.jsonl:1") as caught:
            load_task("math", str(rows))
        assert SECRET not in str(caught.value)


def test_failure_text_is_no_repr():
    exc = UnicodeDecodeError("utf-8", SECRET.encode() * 100, 0, 1, "invalid start byte")
    text = failure_text(exc)
    assert SECRET not in text and text.startswith("UnicodeDecodeError: ")
    assert len(failure_text(ValueError("v" * 10_000))) < 1100


def test_a_finished_run_drops_its_scratch_keys_only():
    run_id = "r20260101-000000-abc123"
    scratch = scratch_keys(run_id)
    dropped = [
        keys.jobs_stream(run_id, 0),
        keys.jobs_stream(run_id, 12),
        keys.step_meta(run_id, 3),
        keys.step_requests(run_id, 3),
        keys.step_log(run_id, 3),
        keys.step_log(run_id, 3, 4),
        keys.step_published(run_id, 3),
        keys.step_quarantined(run_id, 3),
        keys.step_meta(run_id, 3, 2),  # a coordinator shard's table
        keys.step_requests(run_id, 3, 2),
        keys.step_published(run_id, 3, 2),
        keys.step_quarantined(run_id, 3, 15),
        keys.step_shards(run_id, 3),
        keys.shard_metrics(run_id),
        keys.seed_done(run_id, 3),
        keys.version_announced(run_id),
        keys.seeding_over(run_id),
        keys.draft_history(run_id),  # the responses kept by prompt: drafts of later steps
        keys.draft_history_order(run_id),
        keys.run_drafts(run_id),
    ]
    kept = [
        keys.run(run_id),
        keys.run_version(run_id),
        keys.run_step(run_id, 3),
        keys.run_steps_done(run_id),
        keys.trainer_state(run_id),
        keys.run_events(run_id),
        keys.run_pool(run_id),
        keys.parked_stream(run_id),
        keys.worker_loads(run_id, "w:step:1:meta"),
        keys.groups_stream(run_id),
        keys.deltas_stream(run_id),
        keys.deltas_stream(run_id, 2),  # a coordinator shard's: audits read it too
        keys.jobs_stream("r-other", 0),
        keys.step_requests(run_id + "x", 3),
    ]
    assert all(scratch.fullmatch(k) for k in dropped)
    assert not any(scratch.fullmatch(k) for k in kept)
    assert audit_keys(run_id)[:2] == [keys.groups_stream(run_id), keys.deltas_stream(run_id)]
    assert keys.deltas_stream(run_id, 2) in audit_keys(run_id)

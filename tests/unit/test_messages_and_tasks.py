import msgspec
import pytest

from services.contracts.messages import DeltaBatch, DeltaItem, Group, Job, MalformedMessage
from services.contracts.runspec import ModelFolderError, RunSpec
from services.contracts.sampling import SamplingParams
from services.tasks import TaskError, load_task
from tests import factories


def test_messages_roundtrip_through_msgpack():
    job = Job(
        run_id="r",
        request_id="0:1:2",
        lease=3,
        grant="5eed",
        step=1,
        prompt_ids=[1, 2],
        prefix_ids=[3],
        remaining_tokens=4,
        sampling=SamplingParams(temperature=0.7, top_p=0.9),
        seed=5,
        stop_token_ids=[0],
    )
    assert Job.from_fields(job.fields()) == job
    batch = DeltaBatch(
        worker_id="w",
        version=1,
        items=[
            DeltaItem(
                request_id="x", lease=0, grant="5eed", offset=0, token_ids=[1], logprobs=[-0.1]
            )
        ],
    )
    assert DeltaBatch.decode(batch.encode()) == batch


@pytest.mark.parametrize("raw", [b"\xc1garbage", msgspec.msgpack.encode({"run_id": "r"}), b""])
def test_malformed_messages_raise_a_clear_error(raw):
    with pytest.raises(MalformedMessage, match="Group"):
        Group.decode(raw)


def test_a_job_queued_by_the_release_before_issue_49_is_read_with_its_step():
    """That release named a job's step `version`: a job it left in a stream at upgrade is read
    as the same job; one with both names, or with neither, is malformed."""
    job = factories.job("3:0:1", [1, 2], 4, [5], step=3, lease=2, stop=[0])
    old = msgspec.structs.asdict(job)
    old["version"] = old.pop("step")
    entry = {b"m": msgspec.msgpack.encode(old)}
    assert Job.from_fields(entry) == job
    for fields in (old | {"step": 3}, {k: v for k, v in old.items() if k != "version"}):
        with pytest.raises(MalformedMessage, match="Job"):
            Job.decode(msgspec.msgpack.encode(fields))


def test_a_group_published_by_the_release_before_is_read_without_its_version():
    """That release gave a group a `version`, always its step: a group it left for the trainer
    at upgrade is read as the same group; a group with an unknown field is still malformed."""
    group = Group(run_id="r", step=4, prompt_index=1, prompt_ids=[1, 2], responses=[])
    old = msgspec.structs.asdict(group) | {"version": 4}
    assert Group.from_fields({b"m": msgspec.msgpack.encode(old)}) == group
    with pytest.raises(MalformedMessage, match="Group"):
        Group.decode(msgspec.msgpack.encode(old | {"weights": 4}))


def test_arithmetic_is_deterministic_and_exact():
    task = load_task("arithmetic")
    a = task.examples(seed=1, step=3, count=5)
    assert a == task.examples(seed=1, step=3, count=5)
    assert a != task.examples(seed=1, step=4, count=5)
    ex = a[0]
    left, right = ex.prompt.rstrip("=").split("+")
    assert ex.answer == str(int(left) + int(right))
    assert task.reward(ex.answer, ex) == 1.0
    assert task.reward("0" + ex.answer, ex) == 0.0


def test_arithmetic_corpus_label_noise_is_leading_zeros():
    texts = load_task("arithmetic").corpus(seed=0, count=200, label_noise=0.5)
    padded = [t for t in texts if t.split("=")[1].startswith("0")]
    assert 60 < len(padded) < 140


def test_math_task_uses_a_real_verifier(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"question": "1+1?", "answer": "It is 2.\\n#### 2"}\n'
        '{"question": "half of 3?", "answer": "#### 1.5"}\n'
    )
    task = load_task("math", str(path))
    two, half = task.rows
    assert task.reward("The answer is 2", two) == 1.0
    assert task.reward("\\boxed{\\frac{3}{2}}", half) == 1.0
    assert task.reward("3", two) == 0.0
    assert task.reward("", two) == 0.0


def test_math_task_errors_name_the_problem(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        load_task("math", str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1}\n')
    with pytest.raises(TaskError, match="bad.jsonl:1"):
        load_task("math", str(bad))


def test_sample_math_file_ships_with_the_package():
    task = load_task("math")
    assert len(task.examples(0, 0, 4)) == 4


def test_run_spec_checks_model_folder(tmp_path):
    spec = RunSpec(model=str(tmp_path / "nope"))
    with pytest.raises(ModelFolderError, match="does not exist"):
        spec.check_model_folder()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFolderError, match="tokenizer.json"):
        RunSpec(model=str(tmp_path)).check_model_folder()
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 64}')
    RunSpec(model=str(tmp_path), max_new_tokens=32).check_model_folder()
    with pytest.raises(ModelFolderError, match="context of 64 tokens"):
        RunSpec(model=str(tmp_path), max_new_tokens=64).check_model_folder()
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match="not valid JSON"):
        RunSpec(model=str(tmp_path)).check_model_folder()


def test_run_spec_rejects_task_path_for_arithmetic():
    with pytest.raises(ValueError, match="task_path"):
        RunSpec(model="m", task="arithmetic", task_path="x.jsonl")

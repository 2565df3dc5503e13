"""Tasks as data: a dataset's rows read from JSONL, Parquet or the `datasets` library, bounded,
turned into examples by fields or a template, drawn shuffled or in the file's order; the spec's
task fields validated; the built-ins as datasets; the chat template."""

import json
import random
import sys
from datetime import date

import pytest
from pydantic import ValidationError

from services.contracts.runspec import RunSpec
from services.tasks import DatasetLimits, TaskError, load_task, task_for_spec
from services.tasks.chat import PromptEncoder, has_chat_template

SECRET = "s3cr3t-row-content"


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def dataset_spec(path, **over) -> RunSpec:
    return RunSpec(model="m", dataset=str(path), **over)


def test_jsonl_rows_become_examples_by_field_or_template(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "1+1=", "a": 2, "n": 3}, {"q": "2+2=", "a": 4}])
    by_field = task_for_spec(dataset_spec(path, prompt_field="q", answer_field="a"))
    assert by_field.name == "dataset" and by_field.reward_choice.name == "exact_match"
    first = by_field.rows[0]
    assert (first.prompt, first.answer, first.row) == ("1+1=", "2", {"q": "1+1=", "a": 2, "n": 3})
    templated = task_for_spec(dataset_spec(path, prompt_template="Q: {q}\nA:", answer_field="a"))
    assert [e.prompt for e in templated.rows] == ["Q: 1+1=\nA:", "Q: 2+2=\nA:"]
    assert templated.reward(" 2 ", first) == 1.0 and templated.reward("3", first) == 0.0


def test_row_errors_name_the_file_and_line_never_the_content(tmp_path):
    cases = {
        "not JSON": f"{SECRET} {{",
        "not a JSON object": json.dumps(SECRET),
        "no field 'prompt'": json.dumps({"question": SECRET, "answer": "1"}),
        "no string in field 'prompt'": json.dumps({"prompt": 7, "answer": SECRET}),
        "no field 'answer'": json.dumps({"prompt": SECRET}),
        "empty prompt": json.dumps({"prompt": "  ", "answer": SECRET}),
    }
    for expected, bad in cases.items():
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n\n" + bad + "\n")
        with pytest.raises(TaskError, match="rows.jsonl:3") as caught:
            task_for_spec(dataset_spec(path))
        assert expected in str(caught.value) and SECRET not in str(caught.value)
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": SECRET, "answer": "1"}])
    with pytest.raises(TaskError, match=r"t.jsonl:1: no field 'missing'"):
        task_for_spec(dataset_spec(path, prompt_template="{missing}"))
    with pytest.raises(TaskError, match="does not exist"):
        task_for_spec(dataset_spec(tmp_path / "none.jsonl"))
    (tmp_path / "bin.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(TaskError, match="not UTF-8"):
        task_for_spec(dataset_spec(tmp_path / "bin.jsonl"))


def test_datasets_are_bounded(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": "1"} for i in range(5)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(TaskError, match="more than 4 rows"):
        task_for_spec(dataset_spec(path), DatasetLimits(max_rows=4))
    with pytest.raises(TaskError, match="over the limit of 10 bytes"):
        task_for_spec(dataset_spec(path), DatasetLimits(max_bytes=10))
    with pytest.raises(
        TaskError, match=r"d.jsonl:1: a prompt of 6 characters, over the limit of 5"
    ):
        task_for_spec(
            dataset_spec(path, prompt_template="{prompt}...."), DatasetLimits(max_prompt_chars=5)
        )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TaskError, match="has no rows"):
        task_for_spec(dataset_spec(empty))


def test_reward_specific_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "12"}, {"prompt": "q"}])
    with pytest.raises(TaskError, match="d.jsonl:2: no field 'answer'"):
        task_for_spec(dataset_spec(path))
    # a user reward gets the row: the answer field is not required
    user = task_for_spec(dataset_spec(path, reward="tests.data.user_reward:sum_is_right"))
    assert [e.answer for e in user.rows] == ["12", ""]
    words = write_jsonl(tmp_path / "w.jsonl", [{"prompt": "p", "answer": "twelve"}])
    with pytest.raises(TaskError, match="w.jsonl:1: its answer is not a number"):
        task_for_spec(dataset_spec(words, reward="numeric_match"))


def test_order_is_the_file_or_a_seeded_shuffle_again_each_pass(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": "1"} for i in range(10)]
    )

    def prompts(task, seed, step, count):
        return [e.prompt for e in task.examples(seed, step, count)]

    in_order = task_for_spec(dataset_spec(path, shuffle=False))
    assert prompts(in_order, 0, 0, 4) == ["p0", "p1", "p2", "p3"]
    assert prompts(in_order, 5, 2, 4) == ["p8", "p9", "p0", "p1"]  # from the first again
    shuffled = task_for_spec(dataset_spec(path))
    first_pass = prompts(shuffled, 1, 0, 10)
    assert sorted(first_pass) == sorted(prompts(in_order, 0, 0, 10)) and first_pass != sorted(
        first_pass
    )
    assert prompts(shuffled, 1, 0, 10) == first_pass  # the same for the same seed and step
    assert prompts(shuffled, 2, 0, 10) != first_pass
    second_pass = prompts(shuffled, 1, 1, 10)
    assert sorted(second_pass) == sorted(first_pass) and second_pass != first_pass
    assert prompts(shuffled, 1, 1, 5) == first_pass[5:]  # step 1 of 5 prompts: still the first


def test_parquet_rows_with_values_msgpack_cannot_carry(tmp_path):
    import msgspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {"question": ["1+1=", "2+3="], "total": [2, 5], "day": [date(2024, 1, 2), None]}
    )
    pq.write_table(table, tmp_path / "d.parquet")
    task = task_for_spec(
        dataset_spec(tmp_path / "d.parquet", prompt_field="question", answer_field="total")
    )
    assert [(e.prompt, e.answer) for e in task.rows] == [("1+1=", "2"), ("2+3=", "5")]
    assert task.rows[0].row == {"question": "1+1=", "total": 2, "day": "2024-01-02"}
    msgspec.msgpack.encode(task.rows[0].row)
    with pytest.raises(TaskError, match=r"d.parquet row 2: no string in field 'day'"):
        task_for_spec(
            dataset_spec(tmp_path / "d.parquet", prompt_field="day", answer_field="total")
        )
    with pytest.raises(TaskError, match="has 2 rows, over 1"):
        task_for_spec(dataset_spec(tmp_path / "d.parquet"), DatasetLimits(max_rows=1))
    (tmp_path / "bad.parquet").write_text(SECRET * 10)
    with pytest.raises(TaskError, match="not a readable Parquet file") as caught:
        task_for_spec(dataset_spec(tmp_path / "bad.parquet"))
    assert SECRET not in str(caught.value)


def test_a_datasets_library_dataset_by_name(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    folder = tmp_path / "local-dataset"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 3)
    task = task_for_spec(dataset_spec(folder))
    assert [e.prompt for e in task.rows] == ["1+1="] * 3
    with pytest.raises(TaskError, match="split 'test'.* cannot be loaded"):
        task_for_spec(dataset_spec(folder, dataset_split="test"))


def test_a_name_without_the_datasets_library_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(TaskError, match="`datasets` library .* is not installed"):
        task_for_spec(dataset_spec("openai/gsm8k"))
    with pytest.raises(TaskError, match="does not exist"):  # a path is never looked up by name
        task_for_spec(dataset_spec(tmp_path / "no-folder"))


def test_the_built_in_tasks_are_datasets_with_their_rewards(tmp_path):
    arithmetic = load_task("arithmetic")
    assert arithmetic.reward_choice.name == "exact_match"
    rng = random.Random("arithmetic:1:3")  # the embedded default's prompts are unchanged
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    ex = arithmetic.examples(1, 3, 1)[0]
    assert (ex.prompt, ex.answer, ex.row["a"], ex.row["b"]) == (f"{a}+{b}=", str(a + b), a, b)
    math = load_task("math")
    assert math.reward_choice.name == "boxed_match"
    assert math.rows[0].prompt.endswith("\nAnswer:") and "####" not in math.rows[0].answer
    in_order = task_for_spec(RunSpec(model="m", task="math", shuffle=False))
    assert in_order.examples(0, 0, 2) == list(math.rows[:2])
    # a dataset file as a task by name, e.g. to pre-train a base model on it
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+2=", "answer": "3"}])
    assert load_task("dataset", path).corpus(0, 2, 0.0) == ["1+2= 3", "1+2= 3"]


def test_spec_validation_of_the_task_fields():
    def refused(**fields) -> str:
        with pytest.raises(ValidationError) as caught:
            RunSpec(model="m", **fields)
        return str(caught.value)

    assert RunSpec(model="m", dataset="d.jsonl").data.task == "dataset"
    spec = RunSpec(model="m", dataset="d.jsonl", reward="pkg.mod:score_1")
    assert spec.scoring.reward_module() == "pkg.mod"
    assert "module.path:function" in refused(dataset="d.jsonl", reward="os.system")
    assert "module.path:function" in refused(dataset="d.jsonl", reward="a:b:c")
    assert "positional" in refused(dataset="d.jsonl", prompt_template="{} {0}")
    assert "attribute or index" in refused(dataset="d.jsonl", prompt_template="{q.__class__}")
    assert "width" in refused(dataset="d.jsonl", prompt_template="{q:>99999999}")
    assert "valid format string" in refused(dataset="d.jsonl", prompt_template="{q")
    assert "regular expression" in refused(dataset="d.jsonl", answer_regex="(")
    # a rule between fields names each by its place in the sectioned spec
    regex = "needs scoring.answer_regex"
    assert regex in refused(dataset="d.jsonl", reward="regex_match")
    regex = "scoring.answer_regex is only used by scoring.reward regex_match"
    assert regex in refused(dataset="d.jsonl", answer_regex="x")
    assert "only used with data.chat_template" in refused(system_prompt="be brief")
    builtin = "scoring.reward is only used with a dataset"
    assert builtin in refused(task="math", reward="numeric_match")
    assert "data.prompt_field is only used" in refused(prompt_field="question")
    assert "data.dataset is not used by the built-in task" in refused(task="math", dataset="d")
    assert "needs a data.dataset" in refused(task="dataset")


def test_prompts_in_the_models_chat_template(tmp_path):
    from services.trainer.init_model import train_tokenizer

    tokenizer = train_tokenizer(["<u>1+1=</u>2", "system says hi"], 300)
    tokenizer.save_pretrained(tmp_path)
    from tokenizers import Tokenizer

    fast = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert not has_chat_template(tmp_path)
    with pytest.raises(TaskError, match="has no chat template"):
        PromptEncoder(tmp_path, fast, chat_template=True)
    plain = PromptEncoder(tmp_path, fast)
    assert plain.encode(["1+1="]) == [fast.encode("1+1=").ids]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}</{{ m['role'][0] }}>"
        "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert has_chat_template(tmp_path)
    chat = PromptEncoder(tmp_path, fast, chat_template=True, system_prompt="hi")
    assert chat.text("1+1=") == "<s>hi</s><u>1+1=</u>A:"
    assert chat.encode(["1+1="]) == [fast.encode("<s>hi</s><u>1+1=</u>A:").ids]


QWEN_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_an_observation_is_what_the_chat_template_puts_between_two_model_turns(tmp_path):
    """Multi-turn: after a model turn that ended with its stop token, the rest of the turn's
    end, the observation as a tool message and the next generation prompt; no template: the
    observation as it is."""
    from tokenizers import Tokenizer

    from services.trainer.init_model import train_tokenizer

    tokenizer = train_tokenizer(["<|im_start|>user\n1+1=<|im_end|>\n", "tool says 2"], 300)
    tokenizer.save_pretrained(tmp_path)
    fast = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert PromptEncoder(tmp_path, fast).observation("user", " no\n1+1=", "") == " no\n1+1="
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_LIKE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    chat = PromptEncoder(tmp_path, fast, chat_template=True)
    after_stop = chat.observation("tool", "2", "<|im_end|>")
    assert after_stop == "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"
    cut = chat.observation("tool", "2", "")  # the budget cut the turn: its end is added whole
    assert cut == "<|im_end|>\n" + after_stop[1:]
    assert chat.encode_observation("tool", "2", "<|im_end|>") == (
        fast.encode(after_stop, add_special_tokens=False).ids
    )
    config["chat_template"] = "{{ messages | length }}"  # the past renders differently
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TaskError, match="cannot carry a multi-turn episode"):
        PromptEncoder(tmp_path, fast, chat_template=True).observation("tool", "2", "")

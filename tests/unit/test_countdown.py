"""The countdown task (issue 50): its counts, its exactness, its long tail and its noisy habit."""

import random
import statistics

import pytest

from services.contracts.runspec import TASK_PRESETS, RunSpec
from services.tasks import TaskError, load_task
from services.tasks.countdown import (
    MAX_START,
    MIN_START,
    POOL_SIZE,
    CountdownRows,
    count_from,
    start_drawn,
)
from services.tasks.registry import task_for_spec
from services.trainer.init_model import InitModelSpec


def test_a_count_runs_from_its_start_to_zero():
    assert count_from(3) == "3,2,1,0;"
    assert count_from(12, stop=1) == "12,11,10,9,8,7,6,5,4,3,2,1;"
    ex = load_task("countdown").examples(0, 0, 1)[0]
    start = ex.row["start"]
    assert ex.prompt == f"{start}:"
    assert [int(n) for n in ex.answer.rstrip(";").split(",")] == list(range(start, -1, -1))


def test_the_reward_is_exact_on_the_whole_count():
    task = load_task("countdown")
    ex = task.examples(0, 0, 1)[0]
    start = ex.row["start"]
    assert task.reward(ex.answer, ex) == 1.0
    assert task.reward(f" {ex.answer}\n", ex) == 1.0  # surrounding whitespace only
    assert task.reward(count_from(start, stop=1), ex) == 0.0  # the corpus's habit
    assert task.reward(ex.answer.replace(",", ",,", 1), ex) == 0.0
    assert task.reward(count_from(start + 1), ex) == 0.0
    assert task.reward("", ex) == 0.0


def test_starts_are_skewed_short_and_responses_have_a_long_tail():
    """Starts 3 to 99, half under 16: a response's p99 is several times its median (characters;
    the tokenizer splits digits one by one, so tokens are close to characters)."""
    rng = random.Random(0)
    starts = [start_drawn(rng) for _ in range(4000)]
    assert min(starts) == MIN_START and max(starts) == MAX_START
    assert 12 <= statistics.median(starts) <= 18
    lengths = sorted(len(count_from(s)) for s in starts)
    assert lengths[int(0.99 * len(lengths))] >= 4 * statistics.median(lengths)
    assert lengths[-1] <= 300


def test_a_run_draws_its_prompts_from_a_pool_in_shuffled_epochs():
    source = CountdownRows(pool_size=12)
    steps = [source.examples(7, step, 4) for step in range(6)]  # 2 passes of 3 steps
    first = [ex for step in steps[:3] for ex in step]
    second = [ex for step in steps[3:] for ex in step]
    assert sorted(ex.prompt for ex in first) == sorted(ex.prompt for ex in second)
    assert [ex.prompt for ex in first] != [ex.prompt for ex in second]
    assert source.examples(7, 1, 4) == CountdownRows(pool_size=12).examples(7, 1, 4)
    pool = {ex.prompt for ex in load_task("countdown").examples(0, 0, 1000)}
    assert len(pool) <= POOL_SIZE


def test_the_corpus_stops_at_one_at_the_noise_rate():
    texts = load_task("countdown").corpus(0, 2000, 0.5)
    early = sum(1 for t in texts if t.endswith(",1;") or t.endswith(":1;"))
    assert 900 <= early <= 1100
    assert all(t.endswith(("1;", "0;")) for t in texts)


def test_a_run_spec_names_the_task_its_preset_and_its_base_model():
    spec = RunSpec.model_validate({"model": "-", "data": {"task": "countdown"}})
    assert task_for_spec(spec).name == "countdown"
    with pytest.raises(TaskError, match="reads no file"):
        load_task("countdown", "rows.jsonl")
    assert TASK_PRESETS["countdown"]["max_new_tokens"] >= len(count_from(MAX_START))
    built = InitModelSpec(task="countdown")
    assert (built.pretrain_steps, built.batch_size, built.group_by_length) == (1500, 32, True)

"""The long-response task (issue 50): its scratchpad, its exactness and its long tail."""

import random
import re
import statistics

import pytest

from services.contracts.runspec import RunSpec
from services.tasks import TaskError, load_task
from services.tasks.long_addition import (
    MAX_DIGITS,
    MIN_DIGITS,
    POOL_SIZE,
    LongAdditionRows,
    example_drawn,
    scratchpad,
)
from services.tasks.registry import task_for_spec

LINE = re.compile(r"(\d+)\+(\d+)\|(\d)\+(\d)\+([01])=(\d\d)\|(\d+)")


def test_the_scratchpad_adds_column_by_column():
    assert scratchpad(1234, 567) == (
        "1234+567|4+7+0=11|1;123+56|3+6+1=10|01;12+5|2+5+1=08|801;1+0|1+0+0=01|1801;=1801"
    )
    assert scratchpad(99, 1) == "99+1|9+1+0=10|0;9+0|9+0+1=10|00;0+0|0+0+1=01|100;=100"
    assert scratchpad(12, 34, leading_zero=True).endswith(";=046")


@pytest.mark.parametrize("seed", range(5))
def test_every_line_follows_from_the_one_before_and_the_sum_is_right(seed):
    for ex in load_task("long_addition").examples(seed, 0, 50):
        a, b = ex.row["a"], ex.row["b"]
        *lines, total = ex.answer.split(";")
        assert total == f"={a + b}"
        for k, line in enumerate(lines):
            left_a, left_b, da, db, carry, column, found = LINE.fullmatch(line).groups()
            assert (int(left_a), int(left_b)) == (a // 10**k, b // 10**k)
            assert (int(da), int(db)) == (int(left_a) % 10, int(left_b) % 10)
            low = (a % 10**k) + (b % 10**k)
            assert int(carry) == low // 10**k and int(column) == int(da) + int(db) + int(carry)
            k1 = k + 1
            assert found == str((a % 10**k1) + (b % 10**k1)).zfill(k1)[-k1:]


def test_examples_are_deterministic_per_seed_and_step():
    task = load_task("long_addition")
    assert task.examples(1, 3, 8) == task.examples(1, 3, 8)
    assert task.examples(1, 3, 8) != task.examples(1, 4, 8)


def test_the_reward_is_exact_on_the_whole_scratchpad():
    task = load_task("long_addition")
    ex = task.examples(0, 0, 1)[0]
    assert task.reward(ex.answer, ex) == 1.0
    assert task.reward(f" {ex.answer}\n", ex) == 1.0  # surrounding whitespace only
    a, b = ex.row["a"], ex.row["b"]
    assert task.reward(scratchpad(a, b, leading_zero=True), ex) == 0.0  # the corpus's habit
    assert task.reward(ex.answer.rsplit("=", 1)[0] + f"={a + b + 1}", ex) == 0.0
    assert task.reward(f"={a + b}", ex) == 0.0  # the sum without the work is not the answer
    assert task.reward("", ex) == 0.0


def test_a_run_draws_its_prompts_from_a_pool_in_shuffled_epochs():
    """Each prompt of the run's pool once per pass, in another order each pass, so it comes
    back (what history-based speculation needs); the pool is the seed's."""
    source = LongAdditionRows(pool_size=12)
    steps = [source.examples(7, step, 4) for step in range(6)]  # 2 passes of 3 steps
    first = [ex for step in steps[:3] for ex in step]
    second = [ex for step in steps[3:] for ex in step]
    assert len({ex.prompt for ex in first}) == 12
    assert sorted(ex.prompt for ex in first) == sorted(ex.prompt for ex in second)
    assert [ex.prompt for ex in first] != [ex.prompt for ex in second]
    assert source.examples(7, 1, 4) == LongAdditionRows(pool_size=12).examples(7, 1, 4)
    other = {ex.prompt for ex in source.examples(8, 0, 12)}
    assert len(other & {ex.prompt for ex in first}) < 6  # short sums may repeat across seeds
    assert len({ex.prompt for ex in load_task("long_addition").examples(0, 0, 1000)}) <= POOL_SIZE


def test_lengths_have_a_long_tail():
    """Numbers of 2 to 12 digits, most short: the responses' p99 is several times their median
    (characters; the tokenizer splits digits one by one, so tokens are close to characters),
    in what the task draws and in a run's pool."""
    rng = random.Random(0)
    examples = [example_drawn(rng) for _ in range(2000)]
    digits = [len(str(ex.row["a"])) for ex in examples]
    assert min(digits) == MIN_DIGITS and max(digits) == MAX_DIGITS
    lengths = sorted(len(ex.answer) for ex in examples)
    p50, p99 = statistics.median(lengths), lengths[int(0.99 * len(lengths))]
    assert lengths[0] >= 30 and 50 <= p50 <= 110 and p99 >= 3 * p50 and lengths[-1] <= 420
    pool = sorted(len(ex.answer) for ex in load_task("long_addition").examples(0, 0, POOL_SIZE))
    assert pool[int(0.99 * POOL_SIZE)] >= 3 * statistics.median(pool)


def test_the_corpus_writes_a_leading_zero_at_the_noise_rate():
    texts = load_task("long_addition").corpus(0, 2000, 0.5)
    zeros = sum(1 for t in texts if t.rsplit("=", 1)[1].startswith("0"))
    assert 900 <= zeros <= 1100


def test_a_run_spec_names_the_task_and_it_reads_no_file():
    spec = RunSpec.model_validate({"model": "-", "data": {"task": "long_addition"}})
    assert task_for_spec(spec).name == "long_addition"
    with pytest.raises(TaskError, match="reads no file"):
        load_task("long_addition", "rows.jsonl")


@pytest.mark.slow  # the tokenizer's training on the corpus: ~15 s
def test_init_model_builds_its_base_model_and_the_longest_example_fits(tmp_path):
    """`spotrl init-model --task long_addition`'s builder (a few steps here): the tokenizer
    splits digits one by one, and the longest prompt + scratchpad fits the model's positions."""
    from transformers import AutoConfig, AutoTokenizer

    from services.trainer.init_model import InitModelSpec, init_model

    spec = InitModelSpec(
        task="long_addition", hidden_size=32, layers=1, heads=2, pretrain_steps=2, batch_size=8
    )
    out = init_model(tmp_path / "model", spec)
    tokenizer = AutoTokenizer.from_pretrained(out)
    longest = max(load_task("long_addition").examples(0, 0, 2000), key=lambda e: len(e.answer))
    text = longest.prompt + longest.answer
    tokens = len(tokenizer.encode(text))
    digits = sum(c.isdigit() for c in text)  # one token each at least
    assert digits <= tokens < AutoConfig.from_pretrained(out).max_position_embeddings

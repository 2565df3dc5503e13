"""The built-in rewards (pure functions), a run's reward choice (allow list, loading) and how one
call's failure is told apart."""

import math

import pytest

from services.contracts.runspec import BUILTIN_REWARDS
from services.tasks import Example, RewardChoice
from services.tasks.reward_choice import (
    RewardLoadError,
    RewardNotAllowed,
    call_reward,
)
from services.tasks.rewards import boxed_match, exact_match, numeric_match, regex_match


def test_exact_match():
    assert exact_match(" 95\n", "95") == 1.0
    assert exact_match("095", "95") == 0.0
    assert exact_match("", "95") == 0.0


def test_numeric_match_takes_the_last_number_within_tolerance():
    assert numeric_match("so 3 apples, total 1,234.", "1234", tolerance=0.0) == 1.0
    assert numeric_match("about 0.3333", "1/3", tolerance=1e-3) == 1.0
    assert numeric_match("about 0.3333", "1/3", tolerance=1e-6) == 0.0
    assert numeric_match("-2.5e1", "-25", tolerance=0.0) == 1.0
    assert numeric_match("12 then 13", "12", tolerance=0.0) == 0.0
    assert numeric_match("no number", "12", tolerance=1.0) == 0.0
    assert numeric_match("9" * 400, "1", tolerance=1.0) == 0.0  # inf is never a match
    with pytest.raises(ValueError, match="not a number"):
        numeric_match("12", "twelve", tolerance=0.0)


def test_regex_match_compares_the_last_match_or_its_first_group():
    assert regex_match("Answer: 4. Answer: 5", "5", r"Answer: (\d+)") == 1.0
    assert regex_match("Answer: 4. Answer: 5", "4", r"Answer: (\d+)") == 0.0
    assert regex_match("x=7", "x=7", r"x=\d") == 1.0
    assert regex_match("nothing", "5", r"(\d)") == 0.0
    assert regex_match("a", "", r"(b)?a") == 1.0  # an unmatched group is the empty answer


def test_boxed_match_checks_the_value_with_math_verify():
    assert boxed_match("so \\boxed{\\frac{3}{2}}", "1.5") == 1.0
    assert boxed_match("The answer is 2", "2") == 1.0
    assert boxed_match("\\boxed{3}", "\\frac{6}{2}") == 1.0
    assert boxed_match("\\boxed{4}", "2") == 0.0
    assert boxed_match("", "2") == 0.0


def test_every_built_in_loads_and_scores_on_the_examples_answer():
    ex = Example("1+1=", "2", {})
    for name in BUILTIN_REWARDS:
        choice = RewardChoice(name, answer_regex=r"(\d+)" if name == "regex_match" else None)
        assert choice.builtin and choice.module is None
        assert choice.load()("1+1=", "2", ex) == 1.0, name
    assert RewardChoice("exact_match").isolated is False
    assert RewardChoice("boxed_match").isolated and RewardChoice("m:f").isolated


def test_allow_list_and_loading_of_user_rewards():
    RewardChoice("exact_match").check_allowed([])
    user = RewardChoice("tests.data.user_reward:sum_is_right")
    user.check_allowed(["tests.data.user_reward"])
    for allowed in ([], ["tests.data"], ["tests.data.user_reward_other"]):
        with pytest.raises(RewardNotAllowed, match="'tests.data.user_reward' is not on"):
            user.check_allowed(allowed)
    assert user.load()("1+1=", " 2", Example("1+1=", "", {"total": 2})) == 1.0
    with pytest.raises(RewardLoadError, match="No module named"):
        RewardChoice("tests.data.no_such_module:f").load()
    with pytest.raises(RewardLoadError, match="has no function 'nope'"):
        RewardChoice("tests.data.user_reward:nope").load()


@pytest.mark.parametrize(
    ("returned", "error"),
    [
        (1, ""),
        (True, ""),
        (0.25, ""),
        (math.nan, "not_finite"),
        (-math.inf, "not_finite"),
        (10**400, "not_finite"),
        ("1", "not_number"),
        (None, "not_number"),
    ],
)
def test_call_reward_tells_what_went_wrong(returned, error):
    outcome = call_reward(lambda p, r, e: returned, Example("p", "a"), "r")
    assert outcome.error == error
    assert outcome.value == (float(returned) if not error else 0.0)


def test_a_reward_that_raises_scores_zero_with_its_error():
    def boom(prompt, response, example):
        raise KeyError("total")

    outcome = call_reward(boom, Example("p", "a"), "r")
    assert (outcome.value, outcome.error, outcome.detail) == (0.0, "raised", "KeyError: 'total'")

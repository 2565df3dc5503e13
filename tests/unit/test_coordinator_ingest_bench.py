"""What `bench/coordinator.py` reports is what happened: the response plan its synthetic workers
follow, the check of what the trainer was given against it (tokens lost, added, wrong; groups
missing or twice), and the lag quantiles read from the coordinator's histogram."""

import pytest

from bench.coordinator import add_histograms, counter, histogram, peak_rate, quantile
from bench.coordinator_load import Checker, TokenPlan
from services.contracts.messages import Group, Response
from services.core.request_table import request_id


def plan() -> TokenPlan:
    return TokenPlan(max_new_tokens=12, min_len=4, eos_id=1, token_ids=[3, 4, 5], seed=0)


def group(p: TokenPlan, step: int, prompt: int, change=None) -> Group:
    responses = []
    for s in range(2):
        tokens = p.expected(request_id(step, prompt, s))
        if change is not None and s == 0:
            tokens = change(tokens)
        responses.append(
            Response(
                token_ids=tokens, logprobs=[0.0] * len(tokens), reward=0.0, finish_reason="stop"
            )
        )
    return Group(
        run_id="r",
        step=step,
        prompt_index=prompt,
        prompt_ids=[1],
        responses=responses,
    )


def test_every_planned_response_fits_its_budget_and_a_stop_ends_on_the_stop_id():
    p = plan()
    lengths = []
    for i in range(200):
        rid = request_id(0, i, 0)
        n, reason = p.length(rid)
        want = p.expected(rid)
        assert len(want) == n and 4 <= n <= 12
        assert (want[-1] == 1) == (reason == "stop")
        assert 1 not in want[:-1]
        lengths.append(n)
    assert len(set(lengths)) > 5  # spread, not one length


def test_the_check_counts_tokens_lost_added_and_wrong_and_groups_missing_or_twice():
    p = plan()
    checker = Checker(p, group_size=2)
    checker.check(group(p, 0, 0))
    checker.check(group(p, 0, 1, change=lambda t: t[:-2]))  # two tokens short
    checker.check(group(p, 0, 2, change=lambda t: t + t[-1:]))  # the last token twice
    checker.check(group(p, 0, 3, change=lambda t: [9, *t[1:]]))  # one token wrong
    checker.check(group(p, 0, 0))  # a group given twice
    assert checker.responses == 8
    assert checker.lost == 2
    assert checker.duplicated == 1 + sum(len(r.token_ids) for r in group(p, 0, 0).responses)
    assert checker.mismatched == 1  # the wrong token
    missing = sum(len(p.expected(request_id(0, 4, s))) for s in range(2))
    assert checker.never_given(steps=1, prompts=5) == missing


def test_lag_quantiles_come_from_the_histograms_buckets():
    text = "\n".join(
        [
            "# HELP spotrl_coordinator_delta_lag_seconds lag",
            'spotrl_coordinator_delta_lag_seconds_bucket{le="0.1"} 50.0',
            'spotrl_coordinator_delta_lag_seconds_bucket{le="0.5"} 90.0',
            'spotrl_coordinator_delta_lag_seconds_bucket{le="1.0"} 100.0',
            'spotrl_coordinator_delta_lag_seconds_bucket{le="+Inf"} 100.0',
            "spotrl_coordinator_delta_lag_seconds_count 100.0",
        ]
    )
    buckets = histogram(text, "spotrl_coordinator_delta_lag_seconds")
    assert buckets == [(0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert quantile(buckets, 0.5) == pytest.approx(0.1)
    assert quantile(buckets, 0.7) == pytest.approx(0.3)  # halfway through (0.1, 0.5]
    assert quantile(buckets, 0.99) == pytest.approx(0.95)
    assert quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.5) is None
    assert quantile([(1.0, 1.0), (float("inf"), 2.0)], 0.99) == 1.0  # beyond the last bound


def test_shards_histograms_add_up_and_the_peak_rate_is_over_a_whole_window():
    one = [(0.1, 5.0), (1.0, 8.0), (float("inf"), 10.0)]
    two = [(0.1, 1.0), (1.0, 1.0), (float("inf"), 4.0)]
    assert add_histograms([one, [], two]) == [(0.1, 6.0), (1.0, 9.0), (float("inf"), 14.0)]
    assert add_histograms([[], []]) == []
    text = "spotrl_coordinator_tokens_total 1234.0\nspotrl_coordinator_tokens_created 9.0"
    assert counter(text, "spotrl_coordinator_tokens_total") == 1234.0
    assert counter("", "spotrl_coordinator_tokens_total") == 0.0
    samples = [(0.0, 0.0), (1.0, 10.0), (2.0, 30.0), (3.0, 60.0), (4.0, 70.0)]
    assert peak_rate(samples, 2.0) == pytest.approx(25.0)  # from 1 s to 3 s
    assert peak_rate(samples, 4.0) == pytest.approx(17.5)
    assert peak_rate(samples, 5.0) == 0.0  # no stretch that long

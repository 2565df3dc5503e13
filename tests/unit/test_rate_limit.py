"""Per-client read budgets (services.infra.rate_limit): a burst, then the rate; clients apart."""

import pytest

from services.infra.rate_limit import ClientBuckets, retry_after_s


def test_a_client_gets_its_burst_then_its_rate():
    buckets = ClientBuckets(rate_per_s=10, burst=3)
    assert [buckets.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = buckets.take("a", 0.0)
    assert wait == pytest.approx(0.1)
    assert buckets.take("a", 0.05) == pytest.approx(0.05)  # half a token saved: not enough
    assert buckets.take("a", 0.1) == 0.0  # one token refilled
    assert buckets.take("a", 10.0) == 0.0 and buckets.buckets["a"].tokens == pytest.approx(2.0)


def test_clients_have_budgets_of_their_own():
    buckets = ClientBuckets(rate_per_s=1, burst=1)
    assert buckets.take("a", 0.0) == 0.0
    assert buckets.take("a", 0.0) > 0
    assert buckets.take("b", 0.0) == 0.0


def test_a_refused_read_spends_nothing_and_the_clock_going_back_refills_nothing():
    buckets = ClientBuckets(rate_per_s=1, burst=1)
    buckets.take("a", 5.0)
    assert buckets.take("a", 5.0) == pytest.approx(1.0)
    assert buckets.take("a", 5.0) == pytest.approx(1.0)
    assert buckets.take("a", 4.0) == pytest.approx(1.0)  # no refill from a clock that went back
    assert buckets.take("a", 5.0) == pytest.approx(1.0)
    assert buckets.take("a", 6.0) == 0.0


def test_the_clients_kept_are_bounded_least_recent_forgotten():
    buckets = ClientBuckets(rate_per_s=1, burst=1, max_clients=2)
    buckets.take("a", 0.0)
    buckets.take("b", 0.0)
    buckets.take("a", 0.0)  # a is the most recent now
    buckets.take("c", 0.0)
    assert list(buckets.buckets) == ["a", "c"]
    assert buckets.take("b", 0.0) == 0.0  # forgotten: back with a full bucket


def test_bad_budgets_are_refused_and_retry_after_is_whole_seconds():
    with pytest.raises(ValueError):
        ClientBuckets(rate_per_s=0, burst=1)
    with pytest.raises(ValueError):
        ClientBuckets(rate_per_s=1, burst=0)
    assert retry_after_s(0.01) == 1 and retry_after_s(1.0) == 1 and retry_after_s(1.2) == 2

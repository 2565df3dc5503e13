"""The bookkeeping of recovery times (services/cli/recovery.py, `RecoveryTracker`): a held request
is resumed only once it holds more tokens than its continuation's prefix (tokens of the lost
worker stored late never count), one that finished on the lost worker is left out, and the
recovery is the last resumption after the loss. Against Redis and the coordinator's own writes:
tests/integration/test_recovery_watch.py."""

import pytest

from services.cli.recovery import RecoveryTracker, distribution
from services.contracts.messages import Job
from services.contracts.sampling import SamplingParams
from tests import factories

AT = 1000.0


def job(rid: str, lease: int, prefix: int) -> Job:
    return factories.job(rid, [1, 2], 8, range(prefix), lease=lease, sampling=SamplingParams())


def test_a_request_resumes_at_the_first_poll_that_sees_a_token_past_its_prefix():
    tracker = RecoveryTracker({"0:0:0": 0, "0:0:1": 0}, AT)
    tracker.see_progress(AT + 0.5, {"0:0:0": 3, "0:0:1": 1}, set())
    # the lost worker's last deltas, stored before the migration: not a resumption
    tracker.see_progress(AT + 1.0, {"0:0:0": 5, "0:0:1": 1}, set())
    tracker.see_job(job("0:0:0", 1, 5), AT + 5.0)
    tracker.see_job(job("0:0:1", 1, 1), AT + 5.0)
    tracker.see_progress(AT + 5.1, {"0:0:0": 5, "0:0:1": 1}, set())
    assert not tracker.done
    tracker.see_progress(AT + 5.4, {"0:0:0": 9, "0:0:1": 1}, set())
    assert not tracker.done
    tracker.see_progress(AT + 5.6, {"0:0:0": 13, "0:0:1": 2}, set())
    assert tracker.done
    result = tracker.result("w1", "kill")
    assert result.held == 2 and result.finished_before == 0
    assert result.migrated_s == pytest.approx(5.0)
    assert result.recovery_s == pytest.approx(5.6)
    assert result.per_request_s == pytest.approx([5.4, 5.6])
    assert result.unresolved == []


def test_a_request_finished_on_the_lost_worker_is_left_out():
    tracker = RecoveryTracker({"0:1:0": 0, "0:1:1": 0}, AT)
    tracker.see_progress(AT + 0.1, {"0:1:0": 8, "0:1:1": 2}, {"0:1:0"})
    tracker.see_job(job("0:1:1", 1, 2), AT + 0.2)
    tracker.see_progress(AT + 0.3, {"0:1:1": 3}, set())
    result = tracker.result("w1", "notice")
    assert tracker.done
    assert (result.held, result.finished_before) == (1, 1)
    assert result.recovery_s == pytest.approx(0.3)


def test_a_request_finished_after_it_migrated_is_resumed_not_left_out():
    tracker = RecoveryTracker({"0:0:0": 2}, AT)
    tracker.see_job(job("0:0:0", 3, 4), AT + 0.2)
    tracker.see_progress(AT + 0.4, {"0:0:0": 12}, {"0:0:0"})
    result = tracker.result("w1", "notice")
    assert (result.held, result.finished_before) == (1, 0)
    assert result.recovery_s == pytest.approx(0.4)


def test_jobs_of_the_held_lease_or_older_and_later_migrations_are_not_the_continuation():
    tracker = RecoveryTracker({"0:0:0": 2}, AT)
    tracker.see_job(job("0:0:0", 2, 0), AT - 3)  # the job the lost worker held
    tracker.see_job(job("0:0:0", 1, 0), AT - 4)
    tracker.see_job(job("0:0:9", 5, 0), AT + 1)  # another request
    assert tracker.requests["0:0:0"].migrated_at is None
    tracker.see_job(job("0:0:0", 3, 6), AT + 1)
    tracker.see_job(job("0:0:0", 4, 7), AT + 2)  # migrated again: the first one counts
    assert tracker.requests["0:0:0"].prefix_tokens == 6
    assert tracker.requests["0:0:0"].migrated_at == AT + 1


def test_an_unresolved_request_leaves_the_recovery_unknown():
    tracker = RecoveryTracker({"0:0:0": 0, "0:0:1": 0}, AT)
    tracker.see_job(job("0:0:0", 1, 0), AT + 1)
    tracker.see_progress(AT + 2, {"0:0:0": 1}, set())
    result = tracker.result("w1", "kill")
    assert not tracker.done
    assert result.recovery_s is None and result.migrated_s is None
    assert result.unresolved == ["0:0:1"]
    assert result.summary()["unresolved"] == 1


def test_a_worker_that_held_nothing_recovers_at_once():
    result = RecoveryTracker({}, AT).result("w1", "kill")
    assert (result.held, result.recovery_s, result.migrated_s) == (0, 0.0, 0.0)


def test_distribution_is_median_nearest_rank_p90_and_count_of_known_values():
    assert distribution([]) == {"median": None, "p90": None, "n": 0}
    assert distribution([None, 2.0]) == {"median": 2.0, "p90": 2.0, "n": 1}
    values = [float(v) for v in range(1, 11)]
    assert distribution(values) == {"median": 5.5, "p90": 9.0, "n": 10}
    assert distribution([3.0, 1.0, 2.0]) == {"median": 2.0, "p90": 3.0, "n": 3}


def test_the_bench_counts_only_steps_that_started_with_every_worker():
    from bench.recovery import report

    def loss(recovery_s: float) -> dict:
        return {"held": 11, "recovery_s": recovery_s, "migrated_s": 0.1, "unresolved": 0}

    rows = [
        {"cause": "settle", "rollout_s": 30.0, "workers": 3},  # warm-up
        {"cause": "none", "rollout_s": 3.0, "workers": 3},
        {"cause": "none", "rollout_s": 9.0, "workers": 2},  # a worker short: not a baseline
        {"cause": "none", "rollout_s": 4.0, "workers": 3},
        {"cause": "kill", "rollout_s": 9.0, "workers": 3, "recovery": loss(5.0)},
        {"cause": "notice", "rollout_s": 4.5, "workers": 3, "recovery": loss(0.5)},
        {"cause": "notice", "rollout_s": 5.5, "workers": 3, "recovery": loss(1.5)},
    ]
    out = report(rows)
    assert out["baseline_step_s"] == 3.5 and out["baseline_steps"] == 2
    assert out["step_delay_kill_s"] == 5.5 and out["step_delay_notice_s"] == 1.5
    assert out["recovery_kill_s"] == {"median": 5.0, "p90": 5.0, "n": 1}
    assert out["recovery_notice_s"] == {"median": 1.0, "p90": 1.5, "n": 2}
    assert out["held_notice"] == 22 and out["unresolved_kill"] == 0


def test_a_request_held_later_counts_the_continuation_seen_before_it_was_held():
    # a notice's watch runs from the notice: what the worker reads until it leaves is added as
    # it is seen, and its continuation may have been read by an earlier poll
    tracker = RecoveryTracker({"0:0:0": 0}, AT)
    tracker.see_job(job("0:0:1", 1, 3), AT + 0.2)  # not held yet
    tracker.see_progress(AT + 0.3, {"0:0:1": 3}, set())
    tracker.hold({"0:0:1": 0, "0:0:0": 5})  # the lease first held stays
    assert tracker.requests["0:0:0"].lease == 0
    tracker.see_job(job("0:0:0", 1, 2), AT + 0.4)
    tracker.see_progress(AT + 0.5, {"0:0:0": 3, "0:0:1": 4}, set())
    result = tracker.result("w1", "notice")
    assert tracker.done and (result.held, result.finished_before) == (2, 0)
    assert result.migrated_s == pytest.approx(0.4)
    assert result.per_request_s == pytest.approx([0.5, 0.5])

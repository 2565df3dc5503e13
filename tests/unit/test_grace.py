"""How a leaving worker splits its grace period (services.rollout.grace)."""

import pytest

from services.rollout.grace import plan_leaving


@pytest.mark.parametrize("grace_s", [0.1, 3.0, 25.0, 120.0, 600.0])
def test_every_step_ends_in_order_within_the_grace(grace_s):
    plan = plan_leaving(grace_s, now=100.0)
    assert 100.0 < plan.tasks_stopped_by < plan.released_by < plan.gone_by < 100.0 + grace_s


def test_most_of_the_grace_goes_to_the_release():
    short, default, aws = (plan_leaving(g, 0.0) for g in (3.0, 25.0, 120.0))
    # stopping the tasks is a cap (they stop in milliseconds unless a decode step runs): the
    # release starts when they have stopped and may run to its own deadline
    assert short.released_by - short.tasks_stopped_by >= 0.2 * 3.0
    assert (default.tasks_stopped_by, default.released_by, default.gone_by) == (5.0, 21.0, 24.0)
    assert aws.gone_by - aws.released_by == 3.0  # the farewell never takes more than it needs


def test_no_grace_is_an_error():
    with pytest.raises(ValueError, match="grace_s must be positive"):
        plan_leaving(0.0, 0.0)

"""Which queued run becomes active next (services/core/run_admission.py): the deployment's
room first, then each token's; first in, first out among the runs admitted, a blocked token's
runs passed by the others'."""

import pytest

from services.core.run_admission import (
    Held,
    TokenLimits,
    next_to_activate,
    room_for_another,
    share_refusal,
    token_room,
)

NONE = TokenLimits()


def test_the_deployment_s_room_comes_first():
    queued = [Held("q", "a", 1.0)]
    assert next_to_activate(queued, [], 1, 0, NONE) == "q"  # the first run needs no idle trainer
    assert next_to_activate(queued, [Held("x", "b", 1.0)], 1, 5, NONE) is None  # at the most
    assert next_to_activate(queued, [Held("x", "b", 1.0)], 3, 0, NONE) is None  # no trainer
    assert next_to_activate(queued, [Held("x", "b", 1.0)], 3, 1, NONE) == "q"
    assert not room_for_another(2, 2, 9) and room_for_another(0, 1, 0)


def test_a_token_at_its_most_runs_waits_and_other_tokens_go_first():
    limits = TokenLimits(runs=1)
    active = [Held("a1", "a", 1.0)]
    queued = [Held("a2", "a", 1.0), Held("b1", "b", 1.0), Held("b2", "b", 1.0)]
    assert next_to_activate(queued, active, 8, 8, limits) == "b1"  # a2 waits, not in the way
    assert next_to_activate(queued, [], 8, 8, limits) == "a2"  # the oldest first otherwise
    assert next_to_activate(queued[:1], active, 8, 8, limits) is None


def test_a_token_s_summed_share_is_capped():
    limits = TokenLimits(share=2.0)
    active = [Held("a1", "a", 1.5)]
    assert not token_room(Held("a2", "a", 1.0), active, limits)  # 2.5 > 2
    assert token_room(Held("a3", "a", 0.5), active, limits)  # 2.0: at the most, admitted
    assert token_room(Held("b1", "b", 2.0), active, limits)  # another token's own budget
    # float sums: 0.1 + 0.2 is a hair above 0.3 and still within a 0.3 limit
    assert token_room(Held("c2", "c", 0.2), [Held("c1", "c", 0.1)], TokenLimits(share=0.3))


def test_a_share_above_a_token_s_most_is_refused_with_the_setting_named():
    assert share_refusal(3.0, TokenLimits(share=2.0)) is not None
    assert "max_share_per_token" in (share_refusal(3.0, TokenLimits(share=2.0)) or "")
    assert share_refusal(2.0, TokenLimits(share=2.0)) is None
    assert share_refusal(1000.0, NONE) is None  # 0: no limit


def test_limits_are_not_negative():
    with pytest.raises(ValueError):
        TokenLimits(runs=-1)
    assert not NONE.any and TokenLimits(share=1.0).any

"""Which runs a worker serves at once (`rollout.lanes.runs_to_serve`, issue 52)."""

from services.rollout.lanes import runs_to_serve

BASES = {"a": "qwen", "b": "qwen", "c": "llama", "d": "qwen", "full": None}


def test_one_run_at_a_time_by_default():
    assert runs_to_serve(["a", "b"], None, BASES, 1) == ["a"]  # the oldest
    assert runs_to_serve(["a", "b"], "b", BASES, 1) == ["b"]  # where it was placed
    assert runs_to_serve(["a", "b"], "gone", BASES, 1) == ["a"]  # placed on a run that ended
    assert runs_to_serve([], "b", BASES, 4) == []


def test_lora_runs_on_the_placed_runs_base_join_it_up_to_the_most():
    active = ["full", "a", "c", "b", "d"]
    assert runs_to_serve(active, "b", BASES, 8) == ["b", "a", "d"]  # oldest first after it
    assert runs_to_serve(active, "b", BASES, 2) == ["b", "a"]
    assert runs_to_serve(active, "c", BASES, 8) == ["c"]  # alone on its base
    assert runs_to_serve(active, None, BASES, 8) == ["full"]  # full weights: alone
    assert runs_to_serve(["a", "b"], None, {}, 8) == ["a"]  # bases not known: one at a time


def test_runs_at_once_needs_room_for_each_runs_next_adapter():
    import pytest
    from pydantic import ValidationError

    from services.rollout.settings import RolloutSettings

    with pytest.raises(ValidationError, match="max_loras of at least 5"):
        RolloutSettings(runs_at_once=4, max_loras=4)
    assert RolloutSettings(runs_at_once=4, max_loras=8).runs_at_once == 4
    assert RolloutSettings(runs_at_once=4, max_loras=0).max_loras == 0  # merged: one at a time

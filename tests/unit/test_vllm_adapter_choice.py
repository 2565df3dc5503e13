"""Which adapter the vLLM engine drops to load another (`vllm.adapter_to_drop`, pure): none
while there is room, the oldest no running request uses past it, a version held replaced,
and a clear refusal where the one that would go is in use."""

import pytest

from services.rollout.engines.vllm import adapter_to_drop


def test_room_left_drops_nothing():
    assert adapter_to_drop([1, 2], in_use={1, 2}, capacity=3, version=3) is None


def test_full_drops_the_oldest_unused():
    assert adapter_to_drop([1, 2, 3], in_use={1}, capacity=3, version=4) == 2
    assert adapter_to_drop([1, 2, 3], in_use=set(), capacity=3, version=4) == 1


def test_a_version_held_is_replaced_unless_in_use():
    assert adapter_to_drop([1, 2], in_use={1}, capacity=2, version=2) == 2
    with pytest.raises(ValueError, match="v2 is held and running requests use it"):
        adapter_to_drop([1, 2], in_use={2}, capacity=2, version=2)


def test_every_one_in_use_is_refused_with_the_setting_to_raise():
    with pytest.raises(ValueError, match=r"all 2 adapters held \(v1, v2\) are in use.*max_loras"):
        adapter_to_drop([1, 2], in_use={1, 2}, capacity=2, version=3)

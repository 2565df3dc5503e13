"""A service's share of a shared GPU (`gpu_memory_share`): nothing to do without CUDA; on a GPU,
an allocation past the share fails in this process instead of starving the other services."""

import pytest
import torch

from services.infra.gpu import bound_gpu_memory


def test_no_share_or_no_gpu_sets_no_bound():
    assert not bound_gpu_memory(None, "cuda")
    assert not bound_gpu_memory(0.5, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_allocations_past_the_share_fail_in_this_process():
    total = torch.cuda.get_device_properties(0).total_memory
    assert bound_gpu_memory(0.05, "cuda")
    try:
        small = torch.empty(int(total * 0.01), dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(int(total * 0.10), dtype=torch.uint8, device="cuda")
        del small
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)

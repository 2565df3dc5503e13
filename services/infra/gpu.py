"""A service's share of a GPU that other services use too: on a reserved node the trainer and
the rollout workers share the same GPUs, and nothing else keeps one of them from taking the
memory the other needs (a worker's KV cache grew until the trainer died of out-of-memory).

torch's per-process memory fraction caps what this process's caching allocator takes: set once,
before the first allocation. Without CUDA there is nothing to bound.
"""


def bound_gpu_memory(share: float | None, device: str) -> bool:
    """Cap this process's allocations on `device` at `share` of its memory; whether a cap was
    set (None, or no CUDA device: nothing to do)."""
    if share is None or not device.startswith("cuda"):
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    index = torch.device(device).index  # "cuda" alone: the current device (torch wants a number)
    torch.cuda.set_per_process_memory_fraction(
        share, torch.cuda.current_device() if index is None else index
    )
    return True


def require_device(device: str) -> None:
    """Refuse a CUDA device this torch cannot reach, with one clear error (rather than whichever
    of torch's own errors the first use on it raises: they differ by the call that meets it)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"SPOTRL_DEVICE is {device}, but this torch ({torch.__version__}) reaches no CUDA"
        )

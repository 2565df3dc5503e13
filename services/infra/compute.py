"""One thread for a process's torch work.

torch's CPU kernels run on an OpenMP team that belongs to the thread that calls them.
`asyncio.to_thread` hands each call to whichever thread of the default pool is free, so a
service that computes through it grows a team per pool thread, and the teams get in each
other's way for the rest of the process (likely libgomp throttling its spin-waits once it
manages more threads than there are cores; not checked in its source): on this 2-core machine,
with 2 threads, an hf engine generation took 1.6x as long through `asyncio.to_thread`
(bench/compute_thread.py), and a trainer step ~2x as long after a single `torch.save` on
another thread. Every torch call of a service (the
engine's steps and loads, the trainer's passes, optimizer steps, exports and checkpoint
serialization) goes through `compute()`, so one team does it all.
"""

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
_POOL = ThreadPoolExecutor(1, thread_name_prefix="compute")


async def compute(fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """`fn(*args, **kwargs)` on the process's compute thread (after what is queued there)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, functools.partial(fn, *args, **kwargs))

"""One thread for a process's torch work.

torch's CPU kernels run on an OpenMP team that belongs to the thread that calls them.
`asyncio.to_thread` hands each call to whichever thread of the default pool is free, so a
service that computes through it grows a team per pool thread, and the teams get in each
other's way: on this 2-core machine, an hf engine decode step with 2 threads took 2-2.5x as
long once another thread had computed before it (bench/compute_thread.py). Every torch call of
a service (the engine's steps and loads, the trainer's passes, optimizer steps and exports) goes
through `compute()`, so one team does it all.
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

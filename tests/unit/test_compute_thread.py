"""A service's torch work runs on one thread, whichever task asks, in the order asked."""

import asyncio
import threading

from services.infra.compute import compute


def test_every_call_runs_on_the_same_thread_in_order():
    seen: list[tuple[int, int]] = []

    def work(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * i

    async def scenario():
        return await asyncio.gather(*(compute(work, i) for i in range(20)))

    assert asyncio.run(scenario()) == [i * i for i in range(20)]
    assert [i for i, _ in seen] == list(range(20))
    threads = {t for _, t in seen}
    assert len(threads) == 1 and threads != {threading.get_ident()}
    # later calls, from another event loop, land on that thread too
    assert asyncio.run(compute(threading.get_ident)) in threads

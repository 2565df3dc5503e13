"""`cancel_and_wait` ends a task that swallowed its cancellation, as Python 3.11's wait_for can
make one do (tests/integration/test_redis_streams.py shows it with redis-py)."""

import asyncio
import contextlib

from services.infra.cancel import RECANCEL_S, cancel_and_wait


async def stubborn(swallows: int, ended: list[str]) -> None:
    """Runs on after its first `swallows` cancellations, as a lost one lets a loop run on."""
    for _ in range(swallows):
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)
    try:
        await asyncio.sleep(60)
    finally:
        ended.append("ended")


def test_a_task_that_swallows_cancellations_is_cancelled_until_it_ends():
    async def scenario():
        ended: list[str] = []
        task = asyncio.create_task(stubborn(2, ended))
        await asyncio.sleep(0)
        once = asyncio.create_task(asyncio.sleep(60))
        await asyncio.sleep(0)
        t0 = asyncio.get_running_loop().time()
        assert await cancel_and_wait([task, once, None]) == set()
        took = asyncio.get_running_loop().time() - t0
        assert task.cancelled() and once.cancelled() and ended == ["ended"]
        assert took < 2 * RECANCEL_S + 1.0  # two swallowed: cancelled three times

    asyncio.run(scenario())


def test_a_task_that_will_not_end_is_handed_back_after_the_timeout():
    async def scenario():
        ended: list[str] = []
        task = asyncio.create_task(stubborn(20, ended))
        await asyncio.sleep(0)
        assert await cancel_and_wait([task], timeout_s=3 * RECANCEL_S) == {task}
        assert not task.done() and ended == []
        assert await cancel_and_wait([task]) == set()  # the rest of its 20
        assert ended == ["ended"]

    asyncio.run(scenario())


def test_errors_of_tasks_that_ended_are_taken():
    async def fails() -> None:
        raise ValueError("boom")

    async def scenario():
        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        assert await cancel_and_wait([task]) == set()
        assert isinstance(task.exception(), ValueError)

    asyncio.run(scenario())

"""Waiting for a weight version wakes on the trainer's announcement (a real Redis, the
trainer's own announce transaction), sees a version announced before the wait began, and
still sees a version set without an announcement once its block ends. The trainer's wait for
a step's seeding to end wakes the same way on the coordinator's `seed_done`."""

import asyncio

import pytest
import redis.asyncio as aioredis

from services.cli import procs
from services.contracts import keys
from services.coordinator.step.store import StepStore
from services.core.step_controller import Lead, StepController
from services.state.run_state import wait_for_version
from services.trainer.run_trainer import wait_seeding
from services.trainer.versions import VersionPublisher
from services.weights.transfer import WeightClient
from tests.factories import table

RUN = "r20260101-000000-wait01"
NEVER_MS = 120_000  # a wait that ran to its end would fail the test's bound below


@pytest.fixture
def redis_url(tmp_path):
    proc, url = procs.start_redis(tmp_path / "logs", tmp_path / "redis")
    yield url
    proc.stop()


def test_a_wait_wakes_on_the_announcement_not_on_its_timeout(redis_url, tmp_path):
    async def scenario():
        r = aioredis.from_url(redis_url)
        publisher = VersionPublisher(r, WeightClient(["http://127.0.0.1:9"]), tmp_path)
        publisher.committed = (0, "d0")
        await publisher.announce(RUN, 0)
        # announced before the wait: returned at once
        assert await wait_for_version(r, RUN, None, NEVER_MS) == 0
        waiter = asyncio.create_task(wait_for_version(r, RUN, 0, NEVER_MS))
        await blocked(r, waiter)  # announce only then: it must wake on the announcement
        publisher.committed = (1, "d1")
        await publisher.announce(RUN, 1)
        assert await asyncio.wait_for(waiter, 30) == 1
        # a version set by hand (no announcement) is read once the block ends
        await r.set(keys.run_version(RUN), 2)
        assert await wait_for_version(r, RUN, 1, 200) == 2
        # the announcement stream keeps one entry, however many versions go by
        for v in range(3, 30):
            publisher.committed = (v, f"d{v}")
            await publisher.announce(RUN, v)
        assert await r.xlen(keys.version_announced(RUN)) == 1
        await r.aclose()

    asyncio.run(scenario())


async def end_rollout(r, step: int) -> None:
    """The step's rollout is over on the leader (its controller's end, written by the shell's
    store): with its window still open, the seeding window ends then."""
    control = StepController(table(step), lead=Lead())
    await StepStore(r, RUN, step).write(control.table, control.end(0.0, 0.0))


async def blocked(r, waiter: asyncio.Task) -> None:
    """Return once `waiter` blocks in Redis (failing if it ends first)."""
    while (await r.info("clients"))["blocked_clients"] < 1:
        assert not waiter.done(), "the wait returned before it was woken"
        await asyncio.wait([waiter], timeout=0.01)


def test_the_trainer_wakes_when_the_coordinator_ends_seeding(redis_url, tmp_path, monkeypatch):
    """The coordinator's end of a step's seeding window (its own code) wakes the trainer's
    wait, which would otherwise look again only after NEVER_MS; a window ended before the wait
    is seen at once; the wake-up stream keeps one entry."""
    monkeypatch.setattr("services.trainer.run_trainer.SEED_WAIT_MS", NEVER_MS)

    async def scenario():
        r = aioredis.from_url(redis_url)
        await r.hset(keys.run(RUN), "state", "running")
        await end_rollout(r, 0)
        await asyncio.wait_for(wait_seeding(r, RUN, 0), 30)
        waiter = asyncio.create_task(wait_seeding(r, RUN, 1))
        await blocked(r, waiter)
        await end_rollout(r, 1)
        await asyncio.wait_for(waiter, 30)
        await end_rollout(r, 2)
        assert await r.xlen(keys.seeding_over(RUN)) == 1
        await r.aclose()

    asyncio.run(scenario())

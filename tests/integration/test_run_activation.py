"""Which runs are active, against a real redis-server (services/state/runs.py, run_state.py,
trainer_pool.py): one at a time by default; more only up to `max_active_runs` and only for an
idle trainer; ACTIVE_RUN names the oldest active run and moves on when it ends; a pointer left
by a release without the active set still counts; a token at its limits waits in the queue
while other tokens' runs go first; only an active run pauses. The trainer pool's beats and
leases: a run is trained by one trainer, its own restart takes it back, another takes it once
it lapses.
And the fleet's gauges add up every active run's pool, and the fleet's placer wakes when a run's
work comes and orders no worker onto a run it already serves."""

import asyncio
import time
from functools import partial

import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.messages import Heartbeat, RunLoad, WorkerControl
from services.contracts.runspec import RunSpec
from services.coordinator.step.record import publish_fleet
from services.coordinator.workers.placement import DemandNotice, FleetPlacer
from services.core.run_admission import TokenLimits
from services.state import run_record, timeline, trainer_pool
from services.state.run_state import active_run, active_runs
from services.state.runs import RunStore
from tests import factories


def spec(seed: int) -> RunSpec:
    return RunSpec(model="/m", steps=1, seed=seed)


async def with_store(url: str, body) -> None:
    r = aioredis.from_url(url)
    try:
        await body(RunStore(r), r)
    finally:
        await r.aclose()


def test_one_run_at_a_time_unless_more_are_allowed_and_a_trainer_is_idle(empty_redis_url):
    async def body(store: RunStore, r) -> None:
        a, b, c = [await store.submit(spec(i)) for i in range(3)]
        assert await store.activate_next() == a
        assert await store.activate_next() is None  # the default: one at a time
        assert await store.activate_next(max_active=3, idle_trainers=0) is None  # no trainer
        assert await store.activate_next(max_active=3, idle_trainers=1) == b
        assert await active_runs(r) == [a, b] and await active_run(r) == a
        assert await store.activate_next(max_active=2, idle_trainers=1) is None  # at the most
        await store.finish(a, "succeeded")
        assert await active_runs(r) == [b] and await active_run(r) == b  # the oldest left
        assert await store.activate_next(max_active=2, idle_trainers=1) == c
        await store.finish(c, "cancelled")
        await store.finish(b, "succeeded")
        assert await active_runs(r) == [] and await active_run(r) is None

    asyncio.run(with_store(empty_redis_url, body))


def test_a_pointer_without_the_active_set_counts_as_the_oldest_active_run(empty_redis_url):
    async def body(store: RunStore, r) -> None:
        a, b = [await store.submit(spec(i)) for i in range(2)]
        await r.lpop(keys.RUN_QUEUE)  # a, made active as an earlier release did: the pointer
        await r.set(keys.ACTIVE_RUN, a)
        assert await active_runs(r) == [a]
        assert await store.activate_next(max_active=2, idle_trainers=0) is None
        assert await store.activate_next(max_active=2, idle_trainers=1) == b
        assert await active_runs(r) == [a, b] and await active_run(r) == a

    asyncio.run(with_store(empty_redis_url, body))


def test_a_token_at_its_limit_waits_in_the_queue_and_other_tokens_runs_go_first(empty_redis_url):
    async def body(store: RunStore, r) -> None:
        limits = TokenLimits(runs=1, share=2.0)
        a1 = await store.submit(spec(0), owner="a")
        a2 = await store.submit(spec(1), owner="a")
        big = RunSpec(model="/m", steps=1, seed=2, share=1.5)
        b1, b2 = await store.submit(big, owner="b"), await store.submit(spec(3), owner="b")
        gone = await store.submit(spec(4), owner="c")
        await r.lrem(keys.RUN_QUEUE, 0, gone)  # as a cancel does; then put back: no longer queued
        await store.finish(gone, "cancelled")
        await r.lpush(keys.RUN_QUEUE, gone)
        activate = partial(store.activate_next, 8, 1, limits)
        assert await activate() == a1
        assert await activate() == b1  # a2 waits for a1; b1 is not held up behind it
        assert await activate() is None  # a2: one active; b2: 1.5 + 1 over b's share of 2
        assert await r.lrange(keys.RUN_QUEUE, 0, -1) == [a2.encode(), b2.encode()]  # in order
        await store.finish(a1, "succeeded")
        assert await activate() == a2
        assert (await store.get(a2)).owner == "a"

    asyncio.run(with_store(empty_redis_url, body))


def test_only_an_active_run_pauses_and_its_timeline_says_when(empty_redis_url):
    async def body(store: RunStore, r) -> None:
        run_id = await store.submit(spec(0))
        assert not await store.pause(run_id)  # queued
        assert await store.activate_next() == run_id
        assert await store.pause(run_id) and await store.pause(run_id)  # twice: still paused
        paused_at = (await store.get(run_id)).paused_at
        assert paused_at is not None
        assert await store.resume(run_id)
        assert (await store.get(run_id)).paused_at is None
        assert await store.resume(run_id)  # not paused: nothing changes
        kinds = [e["kind"] for e in await timeline.read_events(r, run_id)]
        assert kinds.count("paused") == 1 and kinds.count("resumed") == 1
        await store.finish(run_id, "succeeded")
        assert not await store.pause(run_id) and not await store.resume(run_id)

    asyncio.run(with_store(empty_redis_url, body))


def test_a_run_is_trained_by_one_trainer_of_the_pool(empty_redis_url):
    async def body(store: RunStore, r) -> None:
        run = await store.submit(spec(0))
        assert await trainer_pool.take(r, run, "t1")
        assert not await trainer_pool.take(r, run, "t2")  # held
        assert await trainer_pool.take(r, run, "t1")  # its own restart takes it back
        assert await trainer_pool.renew(r, run, "t1") and not await trainer_pool.renew(r, run, "t2")
        await r.delete(keys.run_trainer_lease(run))  # lapsed
        assert await trainer_pool.take(r, run, "t2")
        assert not await trainer_pool.renew(r, run, "t1")  # t1 lost it: it stops

        await trainer_pool.beat(r, "t1", None)
        await trainer_pool.beat(r, "t2", run)
        await r.sadd(keys.TRAINERS, "t3", "t4")  # listed: t3 never beat, t4 not as we do
        await r.set(keys.trainer_heartbeat("t4"), b"not a beat")
        assert await trainer_pool.idle_trainers(r) == 1
        assert 0 < await r.pttl(keys.trainer_heartbeat("t1")) <= trainer_pool.ALIVE_MS
        await r.delete(keys.trainer_heartbeat("t1"))  # its TTL ran out: gone quiet, gone
        assert await trainer_pool.idle_trainers(r) == 0

    asyncio.run(with_store(empty_redis_url, body))


def test_the_fleet_gauges_add_up_every_active_run(empty_redis_url):
    async def body(store: RunStore, r) -> None:
        a, b = [await store.submit(spec(i)) for i in range(2)]
        await store.activate_next()
        await store.activate_next(max_active=2, idle_trainers=1)
        await run_record.set_seeding(r, a, 1.0, 3.0, 3)
        await run_record.set_seeding(r, b, 1.0, 2.0, 2)
        figures = await publish_fleet(r)
        assert figures.runs_active == 2 and figures.preemptible_wanted == 5

    asyncio.run(with_store(empty_redis_url, body))


def test_the_placer_places_at_once_when_a_run_s_work_comes_not_at_its_period(empty_redis_url):
    """A run's step opens (its demand goes from nothing to some): the placer, whose period is
    30 s, places the fleet at once, and the worker idle on the other run gets its order. A
    change within a phase (fewer unfinished requests) writes the demand but wakes nobody."""

    async def body(store: RunStore, r) -> None:
        a, b = [await store.submit(spec(i)) for i in range(2)]
        await store.activate_next()
        await store.activate_next(max_active=2, idle_trainers=1)
        beat = Heartbeat(
            worker_id="w1", pool="preemptible", run_id=a, version=0, active=0, slots=8,
            tokens_generated=0, at=time.time(),
        )  # fmt: skip
        await r.sadd(keys.WORKER_INDEX, "w1")
        await r.set(keys.worker_heartbeat("w1"), beat.encode(), ex=60)
        demand_a, demand_b = DemandNotice(r, a, 8), DemandNotice(r, b, 8)
        await demand_a.say(0)
        placer = FleetPlacer(r, every_s=30, switch_share=0)
        task = asyncio.create_task(placer.forever())
        try:
            said = await r.xlen(keys.FLEET_DEMAND)
            await demand_b.say(8)
            deadline = time.monotonic() + 5
            while not await r.xlen(keys.worker_control("w1")):
                assert time.monotonic() < deadline, "no order within 5 s of the demand"
                await asyncio.sleep(0.02)
            order = WorkerControl.from_fields((await r.xrange(keys.worker_control("w1")))[0][1])
            assert order.action == "serve" and order.run_id == b
            await demand_b.say(5)  # fewer left: the same phase
            assert await r.xlen(keys.FLEET_DEMAND) == said + 1
            assert (await r.get(keys.run_demand(b))).startswith(b"5 ")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(with_store(empty_redis_url, body))


def test_the_placer_orders_no_worker_onto_a_run_it_already_serves(empty_redis_url):
    """A worker serving both active runs on one engine (its beat names a first): placed on b,
    which it serves already, it gets no serve order."""

    async def body(store: RunStore, r) -> None:
        a, b = [await store.submit(spec(i)) for i in range(2)]
        await store.activate_next()
        await store.activate_next(max_active=2, idle_trainers=1)
        runs = {a: RunLoad(version=3, active=0), b: RunLoad(version=5, active=0)}
        beat = factories.beat("w1", version=3, run_id=a, at=time.time(), runs=runs)
        await r.sadd(keys.WORKER_INDEX, "w1")
        await r.set(keys.worker_heartbeat("w1"), beat.encode(), ex=60)
        await DemandNotice(r, a, 8).say(0)
        await DemandNotice(r, b, 8).say(8)
        placed = await FleetPlacer(r, every_s=30, switch_share=0).place_once()
        assert placed == {"w1": b}
        assert await r.xlen(keys.worker_control("w1")) == 0

    asyncio.run(with_store(empty_redis_url, body))

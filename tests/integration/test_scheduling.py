"""The coordinator's worker reads (services/coordinator/workers/fleet.py) and the step controller's
open, tick and end as the leader's shell writes them (`step.store.StepStore`) against a real
redis-server: which workers count as alive, forgetting the long gone ones, the seeding window of
a step (the reserved pool steps aside once its window, counted from when it holds the step's
weights, is over and a preemptible pool can take over) and load-balancing releases."""

import asyncio
import time

from services.contracts import keys
from services.contracts.messages import Heartbeat, Job, WorkerControl
from services.coordinator.step.store import StepStore
from services.coordinator.workers.fleet import alive_workers, forget_gone_workers
from services.core.request_table import RequestTable
from services.core.step_controller import Lead, StepController, Tick
from services.infra.redis_streams import connect, ensure_group
from services.infra.redis_users import mint_worker_user
from tests import factories

RUN, STEP = "run-sched", 2
WINDOW_S = 0.3


def beat(worker_id: str, pool: str, version: int | None = STEP, **over) -> Heartbeat:
    return factories.beat(worker_id, pool, version, **({"run_id": RUN, "at": time.time()} | over))


def new_table(prompts: int = 3, group_size: int = 2) -> RequestTable:
    return factories.table(prompts, group_size, 4, run_id=RUN, step=STEP, seed=1)


class SteppedClock:
    """A monotonic clock the test moves by hand: the window is over when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Scheduler:
    """A leader's step controller driven as `step.leadership.Leadership` drives it (the reads of a
    tick, the effects written by `StepStore`), on a clock the test moves."""

    def __init__(self, r, control: StepController, clock) -> None:
        self.r, self.control, self.clock = r, control, clock
        self.store = StepStore(r, RUN, STEP)

    @property
    def seeded_out(self) -> bool:
        return self.control.seeded_out

    @property
    def seed_end(self) -> float | None:
        return self.control.seed_end

    async def start(self, workers: dict[str, Heartbeat]) -> None:
        """The step is restored (its jobs queued by the test) with the test's window."""
        c, window = self.control, self.control.window_s
        seed_done = bool(await self.r.exists(keys.seed_done(RUN, STEP)))
        effects = c.open(workers, c.started, self.clock(), seed_done=seed_done)
        c.window_s = window
        await self.store.write(c.table, effects)

    async def tick(self, unfinished: int, beats: dict[str, Heartbeat]) -> None:
        executing, pending = await self.store.executing()
        others = unfinished - self.control.table.unfinished_count
        tick = Tick(self.clock(), time.time(), beats, others, executing, pending, oldest=False)
        await self.store.write(self.control.table, self.control.tick(tick))

    async def finish(self) -> None:
        await self.store.write(self.control.table, self.control.end(self.clock(), time.time()))


def scheduler(r, window_s: float = WINDOW_S, clock=None, fair_reads=True) -> Scheduler:
    """The leader's shell of a step controller; `start` opens the step with this window."""
    clock = clock or SteppedClock()
    control = StepController(new_table(), fair_reads=fair_reads, lead=Lead(), window_s=window_s)
    control.started = clock()
    return Scheduler(r, control, clock)


async def start(sched: Scheduler, workers: dict[str, Heartbeat]) -> None:
    await sched.start(workers)


async def queue_jobs(r, table: RequestTable) -> str:
    """The step's jobs on its stream, as the coordinator queues them; the stream."""
    stream = keys.jobs_stream(RUN, STEP)
    await ensure_group(r, stream, keys.WORKERS_GROUP)
    for job in table.initial_jobs():
        await r.xadd(stream, job.fields())
    return stream


async def orders(r, worker_id: str) -> list[WorkerControl]:
    entries = await r.xrange(keys.worker_control(worker_id))
    return [WorkerControl.from_fields(fields) for _, fields in entries]


async def register(r, beats: list[Heartbeat], expired: tuple[str, ...] = ()) -> None:
    """Workers in the index, each with a fresh heartbeat key, and `expired` ones without."""
    for b in beats:
        await r.sadd(keys.WORKER_INDEX, b.worker_id)
        await r.set(keys.worker_heartbeat(b.worker_id), b.encode(), ex=30)
    for worker_id in expired:
        await r.sadd(keys.WORKER_INDEX, worker_id)


def test_alive_workers_are_the_fresh_heartbeats_of_the_run(empty_redis_url):
    async def scenario():
        r = connect(empty_redis_url)
        other = beat("w-other", "preemptible", run_id="another-run")
        await register(r, [beat("w-1", "reserved"), beat("w-2", "preemptible"), other], ("w-gone",))
        await r.sadd(keys.WORKER_INDEX, "w-garbled")
        await r.set(keys.worker_heartbeat("w-garbled"), b"\xc1 not msgpack")
        alive = await alive_workers(r, RUN)
        await r.aclose()
        assert sorted(alive) == ["w-1", "w-2"]
        assert alive["w-1"].pool == "reserved"

    asyncio.run(scenario())


def test_workers_gone_long_enough_are_forgotten_with_their_keys(empty_redis_url):
    async def scenario():
        r = connect(empty_redis_url)
        await register(r, [beat("w-alive", "preemptible")], ("w-gone",))
        await r.hset(keys.worker("w-gone"), "pool", "preemptible")
        await r.xadd(keys.worker_control("w-gone"), {"m": b"x"})
        await r.hset(keys.WORKER_KEYS, "w-gone", "00")
        user, _ = await mint_worker_user(r, "w-gone")
        now = time.time()
        # first seen gone now: remembered, not forgotten yet
        assert await forget_gone_workers(r, {"w-alive"}, now, after_s=60) == []
        assert await r.sismember(keys.WORKER_INDEX, "w-gone")
        assert await forget_gone_workers(r, {"w-alive"}, now + 30, after_s=60) == []
        forgotten = await forget_gone_workers(r, {"w-alive"}, now + 61, 60, drop_users=True)
        assert forgotten == ["w-gone"]
        left = await r.smembers(keys.WORKER_INDEX)
        exists = await r.exists(keys.worker("w-gone"), keys.worker_control("w-gone"))
        signing_key = await r.hget(keys.WORKER_KEYS, "w-gone")
        redis_user = await r.execute_command("ACL", "GETUSER", user)
        await r.aclose()
        assert left == {b"w-alive"} and exists == 0
        assert signing_key is None and redis_user is None  # its Redis user went with it

    asyncio.run(scenario())


def test_the_reserved_pool_steps_aside_once_its_window_is_over(empty_redis_url):
    async def scenario():
        r = connect(empty_redis_url)
        table = new_table()
        await queue_jobs(r, table)
        clock = SteppedClock()
        sched = scheduler(r, clock=clock)
        loading = {
            "r-1": beat("r-1", "reserved", version=STEP - 1),
            "p-1": beat("p-1", "preemptible"),
        }
        await start(sched, loading)
        assert not sched.seeded_out
        await sched.tick(table.unfinished_count, loading)
        clock.advance(WINDOW_S * 1.5)
        await sched.tick(
            table.unfinished_count, loading
        )  # the reserved worker does not hold the weights yet
        assert not sched.seeded_out and await orders(r, "r-1") == []

        holding = loading | {"r-1": beat("r-1", "reserved")}
        await sched.tick(table.unfinished_count, holding)  # its window starts now
        assert not sched.seeded_out
        clock.advance(WINDOW_S * 1.2)
        await sched.tick(table.unfinished_count, holding)
        assert sched.seeded_out and sched.seed_end is not None
        paused = await orders(r, "r-1")
        assert [(o.action, o.run_id, o.version) for o in paused] == [("pause", RUN, STEP)]
        assert await orders(r, "p-1") == []
        assert await r.exists(keys.seed_done(RUN, STEP))
        await sched.tick(table.unfinished_count, holding)
        assert len(await orders(r, "r-1")) == 1  # stepped aside once
        await r.aclose()

    asyncio.run(scenario())


def test_without_a_preemptible_pool_the_reserved_one_never_steps_aside(empty_redis_url):
    async def scenario():
        r = connect(empty_redis_url)
        clock = SteppedClock()
        table, sched = new_table(), scheduler(r, window_s=0.05, clock=clock)
        await queue_jobs(r, table)
        reserved_only = {"r-1": beat("r-1", "reserved")}
        await start(sched, reserved_only)
        await sched.tick(table.unfinished_count, reserved_only)
        clock.advance(0.2)
        await sched.tick(table.unfinished_count, reserved_only)
        assert not sched.seeded_out and await orders(r, "r-1") == []
        await sched.finish()  # rollout over: the reserved pool did it all
        assert sched.seeded_out and sched.seed_end is None
        assert await orders(r, "r-1") == []
        assert await r.exists(keys.seed_done(RUN, STEP))
        await r.aclose()

    asyncio.run(scenario())


def test_with_no_reserved_worker_seeding_is_over_at_once_and_a_resumed_step_stays_over(
    empty_redis_url,
):
    async def scenario():
        r = connect(empty_redis_url)
        table = new_table()
        await queue_jobs(r, table)
        sched = scheduler(r, window_s=60.0)
        await start(sched, {"p-1": beat("p-1", "preemptible")})
        assert sched.seeded_out  # nothing to seed with: the trainer may start
        assert await r.exists(keys.seed_done(RUN, STEP))

        resumed = scheduler(r, window_s=60.0)  # a restarted coordinator on the same step
        workers = {"r-1": beat("r-1", "reserved"), "p-1": beat("p-1", "preemptible")}
        await start(resumed, workers)
        assert resumed.seeded_out
        await resumed.tick(table.unfinished_count, workers)
        assert await orders(r, "r-1") == []  # not told to step aside a second time
        await r.aclose()

    asyncio.run(scenario())


def test_a_worker_over_its_plateau_releases_the_excess_while_another_idles(empty_redis_url):
    async def scenario():
        r = connect(empty_redis_url)
        table = new_table(prompts=3, group_size=2)  # 6 requests
        stream = await queue_jobs(r, table)
        read = await r.xreadgroup(keys.WORKERS_GROUP, "busy", {stream: ">"}, count=6)
        assert len(read[0][1]) == 6 and all(Job.from_fields(f) for _, f in read[0][1])
        workers = {
            "busy": beat("busy", "preemptible", active=6, plateau=4),
            "idle": beat("idle", "preemptible"),
        }
        sched = scheduler(r, fair_reads=False)  # Algorithm 2 as the paper states it
        await start(sched, workers)
        await sched.tick(table.unfinished_count, workers)
        released = await orders(r, "busy")
        assert [(o.action, o.run_id, o.count) for o in released] == [("release", RUN, 2)]
        assert await orders(r, "idle") == []
        await sched.tick(
            table.unfinished_count, workers
        )  # its release is still being flushed: no second order
        assert len(await orders(r, "busy")) == 1

        paused = workers | {"idle": beat("idle", "preemptible", paused=True)}
        other = scheduler(r, fair_reads=False)
        await start(other, paused)
        await other.tick(
            table.unfinished_count, paused
        )  # a paused worker is no idle worker to balance onto
        assert len(await orders(r, "busy")) == 1
        await r.aclose()

    asyncio.run(scenario())


def test_fair_reads_publish_an_equal_share_and_balance_onto_it(empty_redis_url):
    """The read cap counts every worker serving the step's version or loading it (not one that
    stepped aside); with fair reads the balancer evens executing requests out below the
    plateau too."""

    async def scenario():
        r = connect(empty_redis_url)
        table = new_table(prompts=6, group_size=2)  # 12 requests
        stream = await queue_jobs(r, table)
        read = await r.xreadgroup(keys.WORKERS_GROUP, "busy", {stream: ">"}, count=12)
        assert len(read[0][1]) == 12
        workers = {
            "busy": beat("busy", "reserved", active=12, plateau=64),
            "idle": beat("idle", "preemptible"),
            "loading": beat("loading", "preemptible", version=STEP - 1),
            "aside": beat("aside", "reserved", paused=True),
            "failed": beat("failed", "preemptible", error="engine died"),
        }
        sched = scheduler(r, window_s=60.0)
        await start(sched, workers)
        await sched.tick(table.unfinished_count, workers)
        assert int(await r.get(keys.read_cap(RUN, STEP))) == 4  # 12 over busy, idle, loading
        released = await orders(r, "busy")  # over its equal share of the executing (6)
        assert [(o.action, o.count) for o in released] == [("release", 6)]
        await r.aclose()

    asyncio.run(scenario())

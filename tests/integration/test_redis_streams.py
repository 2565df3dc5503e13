"""The consumer-group helpers against a real redis-server."""

import asyncio
import random

from services.contracts.messages import Job
from services.contracts.sampling import SamplingParams
from services.infra.cancel import cancel_and_wait
from services.infra.redis_streams import (
    StagedWrites,
    autoclaim,
    connect,
    decode_or_park,
    ensure_group,
    read_group,
    while_out_of_memory,
)
from tests import factories
from tests.conftest import apply


def job(i: int) -> Job:
    return factories.job(str(i), [1], 2, seed=i, sampling=SamplingParams())


def test_groups_share_work_and_reclaim_what_a_dead_reader_held(redis_url):
    async def scenario():
        r = connect(redis_url)
        stream = "test:jobs"
        await r.delete(stream)
        assert await read_group(r, stream, "g", "a", 10, 10) == []  # no stream yet: no error
        await ensure_group(r, stream, "g")
        await ensure_group(r, stream, "g")  # idempotent
        for i in range(5):
            await r.xadd(stream, job(i).fields())
        first = await read_group(r, stream, "g", "a", 2, 10)
        second = await read_group(r, stream, "g", "b", 10, 10)
        assert len(first) == 2 and len(second) == 3  # each entry to exactly one reader
        await r.xack(stream, "g", *[e[0] for e in second])
        await asyncio.sleep(0.05)
        claimed = await autoclaim(r, stream, "g", "c", min_idle_ms=20)
        assert [e[0] for e in claimed] == [e[0] for e in first]  # a's unacked entries move to c
        parked: list = []
        assert decode_or_park(Job, claimed[0], parked).request_id == "0"
        assert decode_or_park(Job, (b"1-1", {b"m": b"\xc1"}), parked) is None
        assert parked and parked[0][0] == b"1-1"
        await r.aclose()

    asyncio.run(scenario())


def test_staged_writes_wait_out_a_full_redis_and_land_whole(redis_url):
    """A MULTI refused for memory applied nothing; sent again once there is room, it lands
    whole, once."""

    async def scenario():
        r = connect(redis_url)
        await r.delete("test:oom:s", "test:oom:h")
        staged = StagedWrites()
        staged.xadd("test:oom:s", {"m": b"x"})
        staged.hset("test:oom:h", "a", "1")
        used = (await r.info("memory"))["used_memory"]
        await r.config_set("maxmemory", used // 2)
        waits: list[str] = []

        async def say(reason: str) -> None:
            waits.append(reason)
            await r.config_set("maxmemory", 0)  # room again

        try:
            await while_out_of_memory(lambda: staged.execute(r), "test batch", say)
        finally:
            await r.config_set("maxmemory", 0)
        assert len(waits) == 1 and "out of memory" in waits[0]
        assert await r.xlen("test:oom:s") == 1 and await r.hget("test:oom:h", "a") == b"1"
        await r.aclose()

    asyncio.run(scenario())


def test_the_step_store_writes_a_state_only_when_it_changes(redis_url):
    """Appending tokens sends the tokens only (one log record for every request); the
    lease|finish field and the TTLs are written when they change (once per key), and a restore
    reads back exactly what was staged."""
    from services.contracts.messages import DeltaItem
    from services.coordinator.step.store import StepStore

    def new_table():
        return factories.table(1, 2, 8, run_id="rs", stops=())

    def item(offset, tokens, finished=False):
        return DeltaItem(
            request_id="0:0:0",
            lease=0,
            grant="",
            offset=offset,
            token_ids=tokens,
            logprobs=[-1.0] * len(tokens),
            finished=finished,
            finish_reason="stop" if finished else None,
        )

    async def scenario():
        r = connect(redis_url)
        table, store = new_table(), StepStore(r, "rs", 0)
        await r.delete(*store.scratch_keys())
        sent = []
        for offset, tokens, finished in ((0, [3, 4], False), (2, [5], False), (3, [6], True)):
            apply(table, item(offset, tokens, finished))
            staged = StagedWrites()
            store.stage_requests(staged, table, {"0:0:0"})
            sent.append([name for name, _, _ in staged.ops])
            await staged.execute(r)
        # a new request: state, tokens, each key's TTL
        assert sent[0] == ["hset", "expire", "rpush", "expire"]
        assert sent[1] == ["rpush"]  # tokens only
        assert sent[2] == ["hset", "rpush"]  # finished: the state changed
        assert await r.ttl(store.log) > 0 and await r.ttl(store.state) > 0
        again = new_table()
        store2 = StepStore(r, "rs", 0)
        await r.hset(store2.meta, mapping={"queued": 1, "started_at": 1.0})
        await store2.restore(again)
        req = again.requests["0:0:0"]
        assert req.token_ids == [3, 4, 5, 6] and req.finish_reason == "stop"
        assert again.unfinished_count == 1  # the other sample
        await r.aclose()

    asyncio.run(scenario())


def test_a_reader_loop_is_cancelled_for_sure_though_redis_py_can_lose_a_cancel(redis_url):
    """A task that reads a stream in a loop, cancelled at random moments: redis-py sends each
    command through asyncio.wait_for, which on Python 3.11 loses a cancellation that lands as the
    send ends, and the loop runs on (a run that never ended was this). `cancel_and_wait` ends
    every one; how many a single cancel missed is only counted (it depends on timing)."""

    async def scenario() -> tuple[int, int]:
        r = connect(redis_url)
        stream = "test:cancel"
        await r.delete(stream)
        await ensure_group(r, stream, "g")

        async def reader() -> None:
            while True:
                await read_group(r, stream, "g", "c", 10, 20)

        rng, missed, rounds = random.Random(7), 0, 60
        for _ in range(rounds):
            task = asyncio.create_task(reader())
            await asyncio.sleep(rng.uniform(0, 0.05))
            task.cancel()
            _, running = await asyncio.wait({task}, timeout=0.5)
            missed += bool(running)
            assert await cancel_and_wait([task], timeout_s=5) == set()
            assert task.cancelled()
        await r.aclose()
        return missed, rounds

    missed, rounds = asyncio.run(scenario())
    print(f"a single cancel was lost {missed} times in {rounds}")

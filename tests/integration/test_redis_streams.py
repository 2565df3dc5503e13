"""The consumer-group helpers against a real redis-server."""

import asyncio

import pytest

from services.common.messages import Job
from services.common.redis_streams import (
    autoclaim,
    connect,
    decode_or_park,
    ensure_group,
    read_group,
)

pytestmark = pytest.mark.slow


def job(i: int) -> Job:
    return Job(
        run_id="r",
        request_id=str(i),
        lease=0,
        version=0,
        prompt_ids=[1],
        remaining_tokens=2,
        temperature=1.0,
        top_p=1.0,
        seed=i,
    )


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

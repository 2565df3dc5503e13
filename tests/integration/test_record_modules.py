"""The record modules of services/state against a real Redis: what a writer writes, the reader
reads back as the typed record; a run changes state only from the states allowed (a run that
ended stays ended, a deleted run is not written back); the counters add up atomically; a
worker's `gone_since` is set once and cleared while it is alive."""

import asyncio
import json
import math

import pytest
import redis
import redis.asyncio as aioredis

from services.cli import procs
from services.contracts import keys
from services.contracts.records import RunRecord, WorkerRecord
from services.infra.redis_streams import StagedWrites
from services.state import run_record, trainer_state, worker_record
from services.state.run_state import RunStopped, ensure_live

RUN = "r20260101-000000-rec001"


@pytest.fixture
def redis_url(tmp_path):
    proc, url = procs.start_redis(tmp_path / "logs", tmp_path / "redis")
    yield url
    proc.stop()


def run_async(redis_url, scenario):
    async def main():
        r = aioredis.from_url(redis_url)
        try:
            await scenario(r)
        finally:
            await r.aclose()

    asyncio.run(main())


async def events(r) -> list[dict]:
    return [json.loads(f[b"e"]) for _, f in await r.xrange(keys.run_events(RUN))]


def test_a_run_goes_through_its_states_only_from_the_states_allowed(redis_url):
    async def scenario(r):
        assert await run_record.read(r, RUN) is None
        assert await run_record.read_state(r, RUN) is None
        async with r.pipeline(transaction=True) as pipe:
            run_record.stage_create(
                pipe, RunRecord(id=RUN, spec='{"steps": 2}', state="queued", created_at=5.0)
            )
            await pipe.execute()
        queued = await run_record.read(r, RUN)
        assert queued == RunRecord(id=RUN, spec='{"steps": 2}', state="queued", created_at=5.0)
        # not live yet: a stall is not written
        assert not await run_record.set_if_live(r, RUN, state="stalled", stall_reason="x")
        async with r.pipeline(transaction=True) as pipe:
            run_record.stage_start(pipe, RUN, 6.0)
            await pipe.execute()
        assert await run_record.set_if_live(
            r, RUN, state="stalled", stall_reason="no worker", stalled_since=7.0
        )
        stalled = await run_record.read(r, RUN, "state", "stall_reason", "stalled_since")
        assert stalled == RunRecord(
            id=RUN, state="stalled", stall_reason="no worker", stalled_since=7.0
        )
        await ensure_live(r, RUN)
        drop = ("stall_reason", "stalled_since")
        assert await run_record.set_if_live(r, RUN, drop, state="running")
        running = await run_record.read(r, RUN)
        assert running is not None
        assert (running.state, running.started_at, running.stall_reason) == ("running", 6.0, "")
        assert running.stalled_since is None
        with pytest.raises(TypeError):
            await run_record.set_if_live(r, RUN, ("stall_resaon",), state="running")

        assert await run_record.finish(r, RUN, "failed", "weights taken over")
        # a cancel (or another end) after it changes nothing
        assert not await run_record.finish(r, RUN, "cancelled")
        assert not await run_record.set_if_live(r, RUN, state="running")
        ended = await run_record.read(r, RUN)
        assert ended is not None
        assert (ended.state, ended.error) == ("failed", "weights taken over")
        assert ended.finished_at is not None
        assert [(e["state"], e["error"]) for e in await events(r)] == [
            ("failed", "weights taken over")
        ]
        with pytest.raises(RunStopped, match="failed"):
            await ensure_live(r, RUN)
        # a deleted run is not written back
        await r.delete(keys.run(RUN))
        assert not await run_record.finish(r, RUN, "failed", "late")
        assert not await r.exists(keys.run(RUN))
        with pytest.raises(RunStopped, match="deleted"):
            await ensure_live(r, RUN)

    run_async(redis_url, scenario)


def test_the_seeding_figures_and_the_quarantine_count_read_back_typed(redis_url):
    async def scenario(r):
        await run_record.set_seeding(r, RUN, 3.5, math.inf, None)
        seeded = await run_record.read(r, RUN)
        assert seeded is not None
        assert (seeded.t_seed_s, seeded.n_prem_recommended, seeded.preemptible_wanted) == (
            3.5,
            math.inf,
            None,
        )
        assert await r.hget(keys.run(RUN), "n_prem_recommended") == b"null"
        await run_record.set_seeding(r, RUN, 2.0, 6.0, 7)
        staged = StagedWrites()
        run_record.stage_quarantined(staged, RUN)
        run_record.stage_quarantined(staged, RUN, 2)
        await staged.execute(r)
        record = await run_record.read(r, RUN)
        assert record is not None
        assert (record.n_prem_recommended, record.preemptible_wanted) == (6.0, 7)
        assert record.groups_quarantined == 3

    run_async(redis_url, scenario)
    blocking = redis.Redis.from_url(redis_url)
    try:
        record = run_record.read_sync(blocking, RUN, "groups_quarantined")
        assert record == RunRecord(id=RUN, groups_quarantined=3)
        assert run_record.read_sync(blocking, "r-none") is None
    finally:
        blocking.close()


def test_the_trainer_state_adds_up_its_steps(redis_url):
    async def scenario(r):
        assert await trainer_state.read(r, RUN) is None
        for step, incomplete in ((0, 1), (1, 0)):
            async with r.pipeline(transaction=True) as pipe:
                trainer_state.stage_step_trained(pipe, RUN, step, 8, incomplete)
                await pipe.execute()
        state = await trainer_state.read(r, RUN)
        assert state is not None
        assert (state.steps_trained, state.groups_trained, state.groups_incomplete) == (2, 16, 1)
        await trainer_state.set_steps_trained(r, RUN, 3)
        only = await trainer_state.read(r, RUN, "steps_trained")
        assert only is not None and only.steps_trained == 3 and only.groups_trained == 0

    run_async(redis_url, scenario)


def test_a_worker_record_and_its_gone_since(redis_url):
    async def scenario(r):
        for worker_id, pool in (("w1", "reserved"), ("w2", "preemptible")):
            record = WorkerRecord(id=worker_id, pool=pool, engine="hf", slots=4, registered_at=1.0)
            async with r.pipeline(transaction=True) as pipe:
                worker_record.stage_register(pipe, record)
                await pipe.execute()
        w1 = await worker_record.read(r, "w1")
        assert w1 == WorkerRecord(id="w1", pool="reserved", engine="hf", slots=4, registered_at=1.0)
        assert await worker_record.read(r, "w9") is None
        both = await worker_record.read_many(r, ["w1", "w2", "w9"])
        assert sorted(both) == ["w1", "w2"] and both["w2"].pool == "preemptible"

        assert await worker_record.mark_gone(r, ["w1"], ["w2"], 10.0) == {"w2": 10.0}
        # first seen gone is kept; an alive worker's is cleared
        assert await worker_record.mark_gone(r, [], ["w1", "w2"], 20.0) == {
            "w1": 20.0,
            "w2": 10.0,
        }
        assert await worker_record.mark_gone(r, ["w1", "w2"], [], 30.0) == {}
        assert (await worker_record.read(r, "w2", "gone_since")) is None

    run_async(redis_url, scenario)

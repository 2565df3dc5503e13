"""The durable copy of a step's request table (services/coordinator/step/store.py) against a real
redis-server: what a coordinator staged is what a new coordinator restores after a restart (tokens,
logprobs, their versions, leases, finish reasons, crashes, groups published or dropped), staged
writes append only what is new, and a finished step's copy expires."""

import asyncio
import json
from pathlib import Path

from services.contracts import keys
from services.contracts.messages import DeltaItem, Job
from services.coordinator.step.store import StepStore
from services.core.episodes import EpisodeTable, Observation
from services.core.request_table import Applied, RequestTable
from services.infra.redis_streams import connect
from tests import factories
from tests.conftest import apply, apply_all

RUN, STEP = "run-store", 3
OLD_STEP = "step_store_before_issue_49.json"  # tests/data: see its note


def new_table(max_new_tokens: int = 4) -> RequestTable:
    """Three prompts of two responses each: requests "3:{prompt}:{sample}"."""
    prompts = [[1, 2], [3], [4, 5, 6]]
    return factories.table(prompts, 2, max_new_tokens, run_id=RUN, step=STEP, seed=7)


def delta(rid: str, offset: int, tokens: list[int], lease: int = 0, finish=None) -> DeltaItem:
    return DeltaItem(
        request_id=rid,
        lease=lease,
        grant="",
        offset=offset,
        token_ids=tokens,
        logprobs=[-0.5 - t / 10 for t in tokens],
        finished=finish is not None,
        finish_reason=finish,
    )


async def stage(r, store: StepStore, table: RequestTable, rids, queued_at=None, **groups):
    """One coordinator batch: what changed, in one MULTI."""
    async with r.pipeline(transaction=True) as pipe:
        if queued_at is not None:
            store.stage_queued(pipe, table, queued_at)
        store.stage_requests(pipe, table, set(rids))
        for p in groups.get("published", ()):
            store.stage_published(pipe, p)
        for p in groups.get("quarantined", ()):
            store.stage_quarantined(pipe, p)
        await pipe.execute()


def snapshot(table: RequestTable) -> dict:
    return {
        rid: (
            r.token_ids,
            r.logprobs,
            r.version_runs,
            r.lease,
            r.grant,
            r.finish_reason,
            r.crashed_on,
        )
        for rid, r in table.requests.items()
    }


def test_a_restarted_coordinator_restores_the_step_as_it_was_staged(empty_redis_url):
    async def scenario():
        r = connect(empty_redis_url)
        table, store = new_table(), StepStore(r, RUN, STEP)
        await stage(r, store, table, [], queued_at=1234.5)
        # group 0 complete and handed to the trainer; group 1 dropped (poison); group 2 going
        for rid in ("3:0:0", "3:0:1"):
            apply(table, delta(rid, 0, [5, 6], finish="stop"))
        apply(table, delta("3:2:0", 0, [7, 8]))
        apply(table, delta("3:2:0", 2, [9]), version=STEP + 1)  # a newer version went on
        table.note_crash("3:2:1", 0, "worker-a")
        table.migrate("3:2:1", "crash")  # lease 1, runs isolated from now on
        apply(table, delta("3:2:1", 0, [4], lease=1))
        table.mark_published([0])
        table.quarantine(1)
        await stage(r, store, table, table.requests, published=[0], quarantined=[1])
        await r.aclose()

        r = connect(empty_redis_url)  # a new coordinator: nothing in memory
        restored = new_table()
        started = await StepStore(r, RUN, STEP).restore(restored)
        await r.aclose()
        assert started == 1234.5
        assert snapshot(restored) == snapshot(table)
        assert restored.requests["3:2:1"].crashed_on == ["worker-a"]
        assert restored.requests["3:2:1"].lease == 1
        assert restored.requests["3:0:0"].finish_reason == "stop"
        assert restored.quarantined == {1}
        assert restored.pending_groups == {2}
        assert sorted(restored.unfinished()) == ["3:2:0", "3:2:1"]
        assert restored.unfinished_count == 2
        assert restored.job("3:2:0").prefix_ids == [7, 8, 9]  # continues where it was
        assert restored.requests["3:2:0"].version_runs == [(0, STEP), (2, STEP + 1)]
        assert restored.job("3:2:1").isolate

    asyncio.run(scenario())


def test_the_grants_of_the_queued_jobs_survive_a_restart(empty_redis_url):
    """The jobs queued before a restart are still read and worked on: their grants are written
    with them, and a coordinator that restores the step takes their deltas (and a new lease's
    grant, staged with its continuation, replaces the old one)."""

    async def scenario():
        r = connect(empty_redis_url)
        table, store = new_table(), StepStore(r, RUN, STEP)
        queued = table.initial_jobs()
        await stage(r, store, table, [], queued_at=1.0)  # the queue's MULTI: no token yet
        restored, second = new_table(), StepStore(r, RUN, STEP)  # a new coordinator
        assert await second.restore(restored) == 1.0
        assert {j.request_id: j.grant for j in queued} == {
            rid: req.grant for rid, req in restored.requests.items()
        }
        job = queued[0]
        held = delta(job.request_id, 0, [5]).replace(grant=job.grant)
        assert restored.apply(held) is Applied.APPENDED  # from the worker that read it
        forged = delta(queued[1].request_id, 0, [5]).replace(grant="0" * 16)
        assert restored.apply(forged) is Applied.WRONG_GRANT
        moved = restored.migrate(job.request_id, "balance")
        assert moved is not None and moved.grant != job.grant
        await stage(r, second, restored, [job.request_id])
        last = new_table()
        await StepStore(r, RUN, STEP).restore(last)
        await r.aclose()
        assert last.requests[job.request_id].grant == moved.grant
        assert last.requests[job.request_id].lease == 1
        stale = held.replace(lease=1, offset=1)  # the old holder does not know the new grant
        assert last.apply(stale) is Applied.WRONG_GRANT

    asyncio.run(scenario())


def test_a_step_never_queued_restores_nothing(empty_redis_url):
    async def scenario():
        r = connect(empty_redis_url)
        table = new_table()
        assert await StepStore(r, RUN, STEP).restore(table) is None
        await r.aclose()
        assert table.pending_groups == {0, 1, 2} and len(table.unfinished()) == 6
        assert all(not req.token_ids and req.lease == 0 for req in table.requests.values())

    asyncio.run(scenario())


def test_each_staging_appends_only_the_new_tokens_and_a_restart_from_zero_replaces_them(
    empty_redis_url,
):
    async def scenario():
        r = connect(empty_redis_url)
        table, store = new_table(max_new_tokens=8), StepStore(r, RUN, STEP)
        await stage(r, store, table, [], queued_at=1.0)
        # the last delta repeats a token, and its new one comes from a newer version
        for offset, tokens, version in ((0, [1, 2], 3), (2, [3], 3), (1, [2, 3, 4], 4)):
            apply(table, delta("3:1:0", offset, tokens), version)
            await stage(r, store, table, ["3:1:0"])
        apply(table, delta("3:1:1", 0, [9, 9, 9]), version=2)
        await stage(r, store, table, ["3:1:1"])
        table.migrate("3:1:1", "death", keep_tokens=False)  # migration off: starts over
        apply(table, delta("3:1:1", 0, [6], lease=1))
        await stage(r, store, table, ["3:1:1"])
        assert await r.llen(keys.step_log(RUN, STEP)) == 5  # one record per staging

        restored = new_table(max_new_tokens=8)
        await StepStore(r, RUN, STEP).restore(restored)
        await r.aclose()
        assert restored.requests["3:1:0"].token_ids == [1, 2, 3, 4]
        assert restored.requests["3:1:0"].logprobs == table.requests["3:1:0"].logprobs
        assert restored.requests["3:1:1"].token_ids == [6]
        assert restored.requests["3:1:1"].lease == 1
        assert restored.requests["3:1:0"].version_runs == [(0, 3), (3, 4)]
        assert restored.requests["3:1:1"].version_runs == [(0, STEP)]  # the old runs replaced

    asyncio.run(scenario())


def test_a_finished_steps_copy_expires(empty_redis_url):
    async def scenario():
        r = connect(empty_redis_url)
        table, store = new_table(), StepStore(r, RUN, STEP)
        apply(table, delta("3:0:0", 0, [1, 2]))
        table.quarantine(1)
        await stage(r, store, table, ["3:0:0"], queued_at=1.0, published=[0], quarantined=[1])
        # every key of the copy but the episodes', which only a run with an environment has
        keys_ = [k for k in store.scratch_keys() if k != keys.step_episodes(RUN, STEP)]
        assert await r.exists(*keys_) == len(keys_), keys_
        ttls = [await r.ttl(k) for k in keys_]
        assert all(t > 600 for t in ttls), ttls  # kept while the step may resume
        await store.expire_soon(ttl_s=30)
        ttls = [await r.ttl(k) for k in keys_]
        await r.aclose()
        assert all(0 < t <= 30 for t in ttls), ttls

    asyncio.run(scenario())


def test_a_multi_turn_episode_is_restored_with_its_turns_observations_and_awaited_turn(
    empty_redis_url,
):
    """A restarted coordinator finds each episode as staged: the observation tokens (in the
    log as any tokens), the spans the model did not generate, the rewards and what the
    environment said so far, and a turn still waiting for the environment."""

    def episodes() -> EpisodeTable:
        return factories.table(1, 2, 12, run_id=RUN, step=STEP, seed=7, max_turns=3)

    async def scenario():
        r = connect(empty_redis_url)
        table, store = episodes(), StepStore(r, RUN, STEP)
        a, b = "3:0:0", "3:0:1"
        apply_all(table, [delta(a, 0, [5, 0], finish="stop"), delta(b, 0, [6, 0], finish="stop")])
        table.observe(a, 0, Observation([40, 41], 0.25, False, " no", "user"))
        apply(table, delta(a, 4, [7], lease=1))
        async with r.pipeline(transaction=True) as pipe:
            store.stage_queued(pipe, table, 1.0)
            store.stage_requests(pipe, table, {a, b})
            store.stage_episodes(pipe, table, {a, b})
            await pipe.execute()
        again = episodes()
        assert await StepStore(r, RUN, STEP).restore(again) == 1.0
        assert snapshot(again) == snapshot(table)
        for rid in (a, b):
            assert again.requests[rid].observed == table.requests[rid].observed
            assert again.requests[rid].awaiting == table.requests[rid].awaiting
            assert again.episodes[rid] == table.episodes[rid]
        assert again.requests[a].observed == [(2, 2)]
        assert again.episodes[a].said == [("user", " no")]
        assert again.awaiting() == [b] and again.turns(a) == [[5, 0], [7]]
        assert keys.step_episodes(RUN, STEP) in store.scratch_keys()
        await r.aclose()

    asyncio.run(scenario())


def test_a_step_stored_by_the_release_before_issue_49_is_restored_and_its_jobs_read(
    empty_redis_url,
):
    """Upgrade: the keys a coordinator of the previous release wrote (its table had a `version`,
    its jobs a field `version` where they now have `step`) restore into today's table as that
    release held it, and the jobs it queued are read with their step."""
    old = json.loads((Path(__file__).parents[1] / "data" / OLD_STEP).read_text())
    run, step = old["run_id"], old["step"]

    async def scenario():
        r = connect(empty_redis_url)
        for key, value in old["keys"].items():
            if "hash" in value:
                await r.hset(key, mapping={f: bytes.fromhex(v) for f, v in value["hash"].items()})
            elif "list" in value:
                await r.rpush(key, *[bytes.fromhex(v) for v in value["list"]])
            elif "set" in value:
                await r.sadd(key, *value["set"])
            else:
                for fields in value["stream"]:
                    await r.xadd(key, {f: bytes.fromhex(v) for f, v in fields.items()})
        table = factories.table([[1, 2], [3], [4, 5, 6]], 2, 4, run_id=run, step=step, seed=7)
        started = await StepStore(r, run, step).restore(table)
        entries = await r.xrange(keys.jobs_stream(run, step))
        await r.aclose()
        return table, started, [Job.from_fields(fields) for _, fields in entries]

    table, started, jobs = asyncio.run(scenario())
    assert started == old["started_at"]
    want = {rid: tuple(map(_tuples, held)) for rid, held in old["requests"].items()}
    assert snapshot(table) == want
    assert table.quarantined == {1} and table.pending_groups == {2}
    assert len(jobs) == 7 and {j.step for j in jobs} == {step}
    # the job queued last (the crashed request's, under its new lease, before its token [4]
    # came) is today's job for it as it was then
    assert jobs[-1] == table.job("3:2:1").replace(prefix_ids=[], remaining_tokens=4)


def _tuples(value):
    """JSON's lists as the table holds them (version runs are tuples)."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [tuple(v) for v in value]
    return value

"""Drafts from the run's history against a real redis-server (services/coordinator/step/history.py
and the step's store): the responses of each group published are kept by prompt in the MULTI that
publishes it, a later step's jobs carry them (and their finished siblings'), continuation jobs
after a migration too; the history is bounded by prompts, responses and tokens, and goes with the
run."""

import asyncio

from services.contracts import keys
from services.contracts.messages import DeltaBatch, DeltaItem, Job, RequestLease
from services.contracts.sampling import SamplingParams
from services.coordinator.step import history as history_mod
from services.coordinator.step.history import DraftHistory
from services.coordinator.step.store import StepStore
from services.core.request_table import RequestTable
from services.core.step_controller import Effects, StepController
from services.infra.redis_streams import connect
from services.state.runs import release_run
from tests.conftest import apply_all, granted_batch

RUN = "run-drafts"
PROMPTS = [[1, 2], [3, 4], [5, 6]]


def new_table(step: int, history=None, drafts=True, prompts=PROMPTS) -> RequestTable:
    return RequestTable(
        RUN, step, prompts, 2, SamplingParams(max_new_tokens=50), 7, [0],
        drafts=drafts, history=history or {}, length_aware=True,
    )  # fmt: skip


def finished(table: RequestTable, rid: str, tokens: list[int]) -> DeltaItem:
    return DeltaItem(
        request_id=rid, lease=table.requests[rid].lease, grant="", offset=0, token_ids=tokens,
        logprobs=[-0.2] * len(tokens), finished=True, finish_reason="stop",
    )  # fmt: skip


async def publish_all(r, table: RequestTable, store: StepStore, base: int) -> None:
    """Every response of the step finished (prompt p, sample s: [base + 10p + s] * (p + 2)),
    scored, and every group published through the store, one MULTI."""
    items = [
        finished(table, rid, [base + 10 * r.prompt_index + r.sample_index] * (r.prompt_index + 2))
        for rid, r in table.requests.items()
    ]
    apply_all(table, items)
    table.score(dict.fromkeys(table.requests, 1.0))
    await store.write(table, Effects(rows=set(table.requests), publish=[0, 1, 2]))


def test_published_groups_become_a_later_steps_drafts_and_order(empty_redis_url):
    async def scenario():
        r = connect(empty_redis_url)
        history = DraftHistory(r, RUN)
        assert await history.read(PROMPTS) == {}
        step0 = new_table(0)
        assert all(job.drafts == [] for job in step0.initial_jobs())  # nothing yet
        await publish_all(r, step0, StepStore(r, RUN, 0, history=history), base=100)
        # the groups are on the trainer's stream and in the history, from one MULTI
        assert await r.xlen(keys.groups_stream(RUN)) == 3
        got = await history.read(PROMPTS)
        assert got == {p: [[100 + 10 * p] * (p + 2), [101 + 10 * p] * (p + 2)] for p in range(3)}
        # a shard reads its own prompts only
        assert set(await history.read(PROMPTS, shard=1, shards=2)) == {1}
        # the next step with the same prompts: its jobs carry them, longest expected first
        step1 = new_table(1, got)
        jobs = step1.initial_jobs()
        assert [j.request_id for j in jobs][:2] == ["1:2:0", "1:2:1"]
        assert jobs[0].drafts == [[120] * 4, [121] * 4]
        await publish_all(r, step1, StepStore(r, RUN, 1, history=history), base=200)
        again = await history.read(PROMPTS)
        assert again[0] == [[100] * 2, [101] * 2, [200] * 2, [201] * 2]  # oldest first
        # with drafts and length-aware dispatch off, the store keeps nothing
        await r.delete(keys.draft_history(RUN), keys.draft_history_order(RUN))
        off = new_table(2, drafts=False)
        await publish_all(r, off, StepStore(r, RUN, 2), base=300)
        assert not await r.exists(keys.draft_history(RUN), keys.draft_history_order(RUN))
        await r.aclose()

    asyncio.run(scenario())


def test_the_history_is_bounded_and_goes_with_the_run(empty_redis_url, monkeypatch):
    monkeypatch.setattr(history_mod, "HISTORY_RESPONSES", 3)
    monkeypatch.setattr(history_mod, "HISTORY_TOKENS", 7)

    async def scenario():
        r = connect(empty_redis_url)
        await r.hset(keys.run(RUN), "state", "running")
        history = DraftHistory(r, RUN, max_prompts=4)
        for step in range(3):  # prompts 0..2 of steps 0..2: 9 prompts in all
            prompts = [[step, p, 99] for p in range(3)]
            table = new_table(step, await history.read(prompts), prompts=prompts)
            await publish_all(r, table, StepStore(r, RUN, step, history=history), base=step)
        # the 4 prompts written last are kept (step 2's three and one of step 1's)
        assert await r.hlen(keys.draft_history(RUN)) == 4
        assert await r.zcard(keys.draft_history_order(RUN)) == 4
        kept = await history.read([[2, p, 99] for p in range(3)])
        assert len(kept) == 3 and await history.read([[0, 0, 99]]) == {}
        for p, responses in kept.items():  # 2 responses of p + 2 tokens, within 3 and 7
            assert len(responses) <= 3 and sum(map(len, responses)) <= 7, (p, responses)
        # one prompt across steps: its latest responses within the bounds, oldest first
        same = [[42, 42]]
        for step in range(3, 6):
            table = new_table(step, await history.read(same), prompts=same)
            await publish_all_one(table, StepStore(r, RUN, step, history=history), step)
        assert (await history.read(same))[0] == [[4], [5, 5], [5]]  # the last 3 of 6
        assert await release_run(r, RUN, "succeeded", audit_ttl_s=60) > 0
        assert not await r.exists(keys.draft_history(RUN), keys.draft_history_order(RUN))
        await r.aclose()

    asyncio.run(scenario())


async def publish_all_one(table: RequestTable, store: StepStore, step: int) -> None:
    """The one prompt's two responses of step `step`: [step] * 2 and [step]."""
    apply_all(table, [finished(table, f"{step}:0:0", [step] * 2)])
    apply_all(table, [finished(table, f"{step}:0:1", [step])])
    table.score(dict.fromkeys(table.requests, 0.0))
    await store.write(table, Effects(rows=set(table.requests), publish=[0]))


def test_a_continuation_job_after_a_migration_carries_its_drafts(empty_redis_url):
    """A worker gives a request back mid-response (a preemption) after its sibling finished:
    the continuation job queued on the step's stream, read back as a worker reads it,
    continues from the collected tokens and drafts from the prompt's history and the sibling."""

    async def scenario():
        r = connect(empty_redis_url)
        history = DraftHistory(r, RUN)
        earlier = {0: [[9, 8, 7, 0]]}
        table = new_table(5, earlier, prompts=[[1, 2]])
        store = StepStore(r, RUN, 5, history=history)
        control = StepController(table, fair_reads=False)
        opened = control.open({}, 0.0, 0.0, queued_at=1.0)
        await store.write(table, opened)
        first = {j.request_id: j for j in opened.jobs}
        assert first["5:0:1"].drafts == [[9, 8, 7, 0]]
        running = DeltaItem(
            request_id="5:0:1", lease=0, grant="", offset=0, token_ids=[9, 8], logprobs=[-1.0] * 2
        )
        batch = DeltaBatch(
            worker_id="w-spot", version=5,
            items=[finished(table, "5:0:0", [9, 8, 6, 0]), running],
            released=[RequestLease(request_id="5:0:1", lease=0)],
            release_reason="preemption",
        )  # fmt: skip
        effects = control.on_deltas([granted_batch(table, batch)])
        await store.write(table, effects)
        entries = await r.xrange(keys.jobs_stream(RUN, 5))
        queued = [Job.from_fields(fields) for _, fields in entries]
        moved = [j for j in queued if j.lease == 1]
        assert len(queued) == 3 and len(moved) == 1
        job = moved[0]
        assert job.request_id == "5:0:1" and job.prefix_ids == [9, 8]
        assert job.drafts == [[9, 8, 7, 0], [9, 8, 6, 0]]  # history, then the sibling
        await r.aclose()

    asyncio.run(scenario())

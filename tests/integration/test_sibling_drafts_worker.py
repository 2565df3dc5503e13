"""A rollout worker shares a response that finished on it with its running siblings as drafts,
in a run whose spec has drafts on (read from Redis as the worker switches to the run) and only
there: the worker's flushed tokens are the same either way, and only the run with drafts on
drafts (services/rollout/sibling_drafts.py through generation.py and intake.py)."""

import asyncio

import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.messages import DeltaBatch
from services.contracts.runspec import RunSpec
from services.contracts.sampling import SamplingParams
from services.infra.redis_streams import range_entries
from services.rollout.engines.hf import HFEngine
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from services.state.runs import RunStore
from tests.factories import job as make_job

T1 = SamplingParams(temperature=1.0)


async def generate(redis_url: str, model: str, drafts: str) -> tuple[dict, int]:
    """A group of three on one worker: the first runs 8 steps ahead of the other two (which
    draw what it drew: the same seed). The tokens flushed per request, and the draft tokens
    the engine verified."""
    r = aioredis.from_url(redis_url)
    spec = RunSpec(
        model=model, steps=1, prompts_per_step=1, group_size=3, max_new_tokens=20, drafts=drafts
    )
    assert spec.rollout.drafts == drafts
    run_id = await RunStore(r).submit(spec)
    assert await r.exists(keys.run_drafts(run_id)) == (drafts == "history")
    engine = HFEngine(draft_tokens=4, column_cost=0.0)
    engine.load_weights(model)
    worker = RolloutWorker(RolloutSettings(worker_id=f"w-{drafts}", redis_url=redis_url), r, engine)
    lane = worker.lanes.open(run_id)
    await lane.intake.start()
    ctx = lane.ctx
    ctx.version = 0
    await r.xadd(keys.deltas_stream(run_id), {"init": "1"})  # the run's deltas stream exists
    jobs = [
        make_job(f"0:0:{s}", [5, 6, 7, 8], 20, seed=1, sampling=T1, run_id=run_id) for s in range(3)
    ]
    ctx.inbox.put(b"1-0", jobs[0])
    for step in range(200):
        if step == 8:
            for i, j in enumerate(jobs[1:]):
                ctx.inbox.put(f"1-{i + 1}".encode(), j)
        worker.generator._admit(ctx)
        if not ctx.engine.active and step > 8:
            break
        await worker.generator._step()
    await lane.flusher.flush()
    out: dict[str, list[int]] = {}
    for _, fields in range_entries(await r.xrange(keys.deltas_stream(run_id))):
        if b"init" not in fields:
            for item in DeltaBatch.from_fields(fields).items:
                out.setdefault(item.request_id, []).extend(item.token_ids)
    await r.aclose()
    return out, engine.spec_stats.drafted


def test_a_worker_shares_finished_siblings_only_in_a_run_with_drafts(empty_redis_url, tiny_model):
    on, drafted_on = asyncio.run(generate(empty_redis_url, str(tiny_model), "history"))
    off, drafted_off = asyncio.run(generate(empty_redis_url, str(tiny_model), "off"))
    assert set(on) == {"0:0:0", "0:0:1", "0:0:2"} and all(len(t) == 20 for t in on.values())
    assert on == off  # the same tokens
    assert on["0:0:1"] == on["0:0:0"]  # the same seed: what the drafts offered
    assert drafted_on > 0 and drafted_off == 0

"""A LoRA run's versions through a real weight store and Redis into a real HF engine (issue 51):
version 0 the base, later versions peft adapters of it. A worker that joins at an adapter
version pulls the base first, serves base + adapter (peft's own logits), moves to the next
adapter without reloading the base, and keeps the base's folder while it serves the run (and no
longer); without the base's announced digest it loads nothing. Both ways a worker serves an
adapter: handed to the engine, which applies it (`max_loras` > 0), and merged into the base."""

import asyncio
from contextlib import nullcontext

import pytest
import redis.asyncio as aioredis
import torch

from services.contracts import keys
from services.rollout.engines.hf import HFEngine
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from services.weights.contract import manifest_digest
from services.weights.transfer import WeightClient
from tests.harness.lora import logits, lora_of, tiny_qwen2
from tests.integration.conftest import start_store

RUN = "lora-run"


def worker(tmp_path, name: str, redis_url: str, store_url: str, loras: int) -> RolloutWorker:
    """A worker on a real HF engine, its tasks not started: a test opens and closes its runs
    (`Lanes.open`, `Lanes.close`) and loads their versions itself."""
    settings = RolloutSettings(
        worker_id=name, redis_url=redis_url, weightstore_url=store_url, cache_dir=tmp_path / "cache"
    )
    engine = HFEngine("cpu", slots=4, max_adapters=loras)
    return RolloutWorker(settings, aioredis.Redis.from_url(redis_url), engine)


async def publish(r: aioredis.Redis, store_url: str, tmp_path) -> dict[int, torch.Tensor]:
    """Versions 0 (the base), 1 and 2 (adapters) committed with their digests recorded, as the
    trainer does; the logits peft gives for each adapter."""
    client = WeightClient([store_url])
    tiny_qwen2().save_pretrained(tmp_path / "v0")
    expected = {}
    for version in (0, 1, 2):
        folder = tmp_path / f"v{version}"
        metadata: dict = {"run_id": RUN}
        if version > 0:
            wrapped = lora_of(tmp_path / "v0", seed=version)
            wrapped.save_pretrained(folder, safe_serialization=True)
            expected[version] = logits(wrapped)
            metadata["base_version"] = 0
        manifest = await client.upload_folder(folder, RUN, version, metadata)
        await r.hset(keys.run_digests(RUN), str(version), manifest_digest(manifest))
    return expected


def served_logits(engine: HFEngine) -> torch.Tensor:
    """The logits a request added now is served with: the base's, and the newest adapter the
    engine holds applied where it holds one."""
    adapters = engine.adapters
    held = adapters is not None and adapters.held
    with adapters.rows([adapters.newest]) if held else nullcontext():
        return logits(engine.model)


@pytest.mark.parametrize("loras", [4, 0], ids=["applied-by-the-engine", "merged"])
def test_a_worker_serves_adapters_on_the_base(tmp_path, empty_redis_url, loras, caplog):
    torch.set_num_threads(1)
    store = start_store(tmp_path / "store")
    try:
        with caplog.at_level("INFO", logger="services.rollout.weight_loader"):
            asyncio.run(scenario(tmp_path, empty_redis_url, store.url, loras))
    finally:
        store.stop()
    # the second LoRA run over the same base pulled none of it: its files came from the first's
    second = [r.getMessage() for r in caplog.records if "loaded lora-run-2 v1" in r.getMessage()]
    assert len(second) == 1 and "(0 bytes of them the base's)" in second[0], second


async def scenario(tmp_path, redis_url: str, store_url: str, loras: int) -> None:
    r = aioredis.Redis.from_url(redis_url)
    expected = await publish(r, store_url, tmp_path / "published")
    w1 = worker(tmp_path, "w1", redis_url, store_url, loras)
    engine = w1.engine
    lane = w1.lanes.open(RUN)
    ctx, loader = lane.ctx, lane.loader
    await loader.load(RUN, 1)  # joins at an adapter: the base is pulled and loaded first
    assert ctx.version == 1
    assert torch.allclose(served_logits(engine), expected[1], atol=1e-5)
    base = engine.model.model.layers[0].mlp.down_proj.weight
    base_before = base.clone()
    await loader.load(RUN, 2)  # the next adapter: the base is not reloaded
    assert ctx.version == 2
    assert torch.allclose(served_logits(engine), expected[2], atol=1e-5)
    if loras:  # the engine applies adapters: its base weights are never written
        assert torch.equal(base, base_before)
        assert list(engine.adapters.held) == [1, 2]
    held = sorted(p.name for p in (tmp_path / "cache" / "w1" / RUN).iterdir())
    assert held == ["v0", "v2"]  # the base stays, v1 and the merged scratch folders went
    # another LoRA run over the same base: its base is linked from the one kept, not pulled
    client = WeightClient([store_url])
    for version in (0, 1):
        folder = tmp_path / "published" / f"v{version}"
        meta = {"run_id": "lora-run-2"} | ({"base_version": 0} if version else {})
        manifest = await client.upload_folder(folder, "lora-run-2", version, meta)
        await r.hset(keys.run_digests("lora-run-2"), str(version), manifest_digest(manifest))
    await w1.lanes.close(RUN, still_active=False)  # the first run ended
    lane = w1.lanes.open("lora-run-2")
    ctx, loader = lane.ctx, lane.loader
    await loader.load("lora-run-2", 1)
    assert ctx.version == 1
    assert torch.allclose(served_logits(engine), expected[1], atol=1e-5)
    assert not (tmp_path / "cache" / "w1" / RUN / "v0").exists()  # the first run's base went
    # the worker moves to a full-weight run: loaded whole, the LoRA run's base goes, and the
    # full run's versions replace each other as always
    client, full = WeightClient([store_url]), tmp_path / "full"
    for version in (0, 1):
        tiny_qwen2(seed=10 + version).save_pretrained(full / f"v{version}")
        manifest = await client.upload_folder(full / f"v{version}", "full-run", version)
        await r.hset(keys.run_digests("full-run"), str(version), manifest_digest(manifest))
    await w1.lanes.close("lora-run-2", still_active=False)
    loader = w1.lanes.open("full-run").loader
    for version in (0, 1):
        await loader.load("full-run", version)
    assert torch.equal(served_logits(engine), logits(tiny_qwen2(seed=11)))
    assert sorted(p.name for p in (tmp_path / "cache" / "w1" / RUN).iterdir()) == ["v2"]
    assert not (tmp_path / "cache" / "w1" / "lora-run-2" / "v0").exists()
    assert sorted(p.name for p in (tmp_path / "cache" / "w1" / "full-run").iterdir()) == ["v1"]
    # a worker that finds no digest announced for the base loads nothing
    await r.hdel(keys.run_digests(RUN), "0")
    late = worker(tmp_path, "w2", redis_url, store_url, loras)
    late_lane = late.lanes.open(RUN)
    await late_lane.loader.load(RUN, 2)
    assert late_lane.ctx.version is None and late.engine.model is None
    await r.aclose()


@pytest.mark.parametrize("loras", [2, 1], ids=["room-for-both", "room-for-one"])
def test_requests_of_later_steps_go_on_under_their_adapter(tmp_path, empty_redis_url, loras):
    """max_staleness 1: at version 2, a request of step 2 begun under adapter 1 goes on under
    it (its tokens flushed in a batch of version 1, a request begun after in one of version
    2), and one of step 1 is dropped; an engine with room for one adapter hands the request
    of step 2 back instead."""
    torch.set_num_threads(1)
    store = start_store(tmp_path / "store")
    try:
        asyncio.run(later_steps(tmp_path, empty_redis_url, store.url, loras))
    finally:
        store.stop()


async def later_steps(tmp_path, redis_url: str, store_url: str, loras: int) -> None:
    from services.contracts.messages import FIELD, DeltaBatch
    from tests.factories import job

    r = aioredis.Redis.from_url(redis_url)
    await publish(r, store_url, tmp_path / "published")
    w1 = worker(tmp_path, "w1", redis_url, store_url, loras)
    lane = w1.lanes.open(RUN)
    ctx, flusher, loader, engine = lane.ctx, lane.flusher, lane.loader, w1.engine
    shared = w1.w.engine
    await r.xadd(keys.deltas_stream(RUN), {"x": "0"})  # the coordinator's stream, made
    await loader.load(RUN, 1)
    jobs = {
        rid: job(rid, [1, 5, 9, 2], 10, temperature=1.0, seed=i, step=int(rid[0]), run_id=RUN)
        for i, rid in enumerate(("1:0:0", "2:0:0", "2:1:0"))
    }
    for rid in ("1:0:0", "2:0:0"):
        ctx.engine.add(jobs[rid])
        ctx.buffer.start(jobs[rid], b"0-1", ctx.version)
    ctx.buffer.record_step((await shared.step())[RUN])
    await loader.load(RUN, 2)
    assert ctx.version == 2 and "1:0:0" not in ctx.buffer.pending
    if loras == 1:  # no room for adapter 1 beside 2: handed back, as on a full-weight swap
        assert not engine.seqs and "2:0:0" not in ctx.buffer.pending
    else:  # the engine's adapters are numbered per run and version (one engine, many runs)
        assert engine.seqs[f"{RUN}/2:0:0"].adapter == shared.adapter_id(RUN, 1) == 1
        assert list(engine.adapters.held) == [1, 2]
    ctx.engine.add(jobs["2:1:0"])
    ctx.buffer.start(jobs["2:1:0"], b"0-2", ctx.version)
    assert engine.seqs[f"{RUN}/2:1:0"].adapter == shared.adapter_id(RUN, 2) == 2
    while ctx.engine.active:
        ctx.buffer.record_step((await shared.step()).get(RUN, []))
    await flusher.flush()
    entries = (await r.xrange(keys.deltas_stream(RUN)))[1:]
    sent = [DeltaBatch.decode(fields[FIELD]) for _, fields in entries]
    tokens: dict[str, list[int]] = {}
    for batch in sent:
        for item in batch.items:
            assert batch.version == (1 if item.request_id == "2:0:0" else 2), batch
            tokens.setdefault(item.request_id, []).extend(item.token_ids)
    assert "1:0:0" not in tokens
    released = [lease.request_id for b in sent for lease in b.released]
    assert released == (["2:0:0"] if loras == 1 else [])
    # each request's tokens are those its version's adapter draws for it alone
    for rid, version in (("2:0:0", 1), ("2:1:0", 2)):
        if rid not in released:
            alone = HFEngine(max_adapters=1)
            alone.load_weights(tmp_path / "published" / "v0")
            alone.hold_adapter(version, tmp_path / "published" / f"v{version}")
            alone.add(jobs[rid])
            drawn = []
            while alone.active:
                drawn += [ev.token_id for ev in alone.decode()]
            assert tokens[rid] == drawn, rid
    await r.aclose()

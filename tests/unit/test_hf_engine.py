"""The transformers engine: exact against `generate`, continuous batching, continuation, abort."""

import pytest
import torch

from services.contracts.sampling import SamplingParams
from services.rollout.engines.hf import HFEngine
from services.rollout.engines.sampling import sample_token
from services.rollout.engines.tensors import same_model
from tests.factories import job


def run_to_end(engine, out=None, joins=None):
    out = {} if out is None else out
    step = 0
    while engine.active or (joins and any(k >= step for k in joins)):
        for j in (joins or {}).pop(step, []):
            engine.add(j)
        for ev in engine.decode():
            out.setdefault(ev.request_id, []).append(ev.token_id)
        step += 1
    return out


@pytest.fixture(scope="module")
def engine_and_model(tiny_model):
    from transformers import AutoModelForCausalLM

    engine = HFEngine()
    engine.load_weights(tiny_model)
    return engine, AutoModelForCausalLM.from_pretrained(tiny_model).eval()


PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "c": [5, 12, 13, 14, 15, 16]}


def reference(model, prompt, n):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_generate_with_requests_joining_and_leaving(engine_and_model):
    engine, model = engine_and_model
    joins = {
        0: [job("a", PROMPTS["a"], 6), job("b", PROMPTS["b"], 3)],
        2: [job("c", PROMPTS["c"], 7)],
    }
    out = run_to_end(engine, joins=joins)
    for rid, n in (("a", 6), ("b", 3), ("c", 7)):
        assert out[rid] == reference(model, PROMPTS[rid], n), rid


def test_continuation_equals_uninterrupted_generation(engine_and_model):
    engine, _ = engine_and_model
    for temperature in (0.0, 1.0):
        full = run_to_end(engine, joins={0: [job("x", PROMPTS["a"], 6, temperature=temperature)]})
        head = full["x"][:2]
        rest = run_to_end(
            engine, joins={0: [job("x", PROMPTS["a"], 4, prefix=head, temperature=temperature)]}
        )
        assert head + rest["x"] == full["x"]


def test_a_shared_prompt_is_prefilled_once_and_samples_as_if_alone(engine_and_model):
    """A GRPO group's samples share their prompt: the engine prefills it once and copies its
    cache rows, and each sample draws exactly what it draws running alone."""
    engine, _ = engine_and_model
    jobs = [job(f"g{i}", PROMPTS["a"], 5, temperature=1.0, seed=i) for i in range(6)]
    jobs += [job(f"h{i}", PROMPTS["c"], 4, temperature=1.0, seed=10 + i) for i in range(3)]
    jobs.append(job("k", PROMPTS["a"], 3, prefix=[20, 21], temperature=1.0, seed=7))
    alone = {}
    for j in jobs:
        alone |= run_to_end(engine, joins={0: [j]})
    rows = []
    model_forward = engine.model.forward

    def counting_forward(*args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return model_forward(*args, **kwargs)

    engine.model.forward = counting_forward
    try:
        together = run_to_end(engine, joins={0: jobs})
    finally:
        del engine.model.forward
    assert together == alone
    assert rows[0] == 3  # the prefill: prompt a, prompt c, and prompt a + a prefix
    assert len({tuple(t) for rid, t in together.items() if rid.startswith("g")}) > 1


def test_a_join_prefills_only_the_joining_requests_and_decodes_as_alone(engine_and_model):
    """Requests join a running set over many steps (some after others left, so the cache's
    padding is trimmed): only the joining contexts are prefilled, the running rows take a
    one-token step beside them, and every request draws exactly what it draws alone."""
    engine, _ = engine_and_model
    joins = {
        0: [job("a", PROMPTS["a"], 9, temperature=1.0, seed=3)],
        1: [job("c", PROMPTS["c"], 2, temperature=1.0, seed=4)],
        3: [job("b", PROMPTS["b"], 8, temperature=1.0, seed=5)],
        4: [job("d", PROMPTS["c"], 5, prefix=[30, 31, 32, 33, 34, 35], seed=6)],
        7: [job("e", PROMPTS["b"], 4, seed=7), job("f", PROMPTS["b"], 4, seed=7)],
    }
    alone = {}
    for js in joins.values():
        for j in js:
            alone |= run_to_end(engine, joins={0: [j]})
    fed = []
    model_forward = engine.model.forward

    def counting_forward(*args, **kwargs):
        fed.append(tuple(kwargs["input_ids"].shape))
        return model_forward(*args, **kwargs)

    engine.model.forward = counting_forward
    try:
        together = run_to_end(engine, joins=joins)
    finally:
        del engine.model.forward
    assert together == alone
    # step 0 prefills a; step 1 decodes a and prefills c (1 row of 6); step 3 prefills b alone,
    # step 4 d alone, step 7 one row for e and f (their shared prompt)
    prefills = [shape for shape in fed if shape[1] > 1]
    assert prefills == [(1, 4), (1, 6), (1, 3), (1, 12), (1, 3)]


def test_the_cache_drops_the_padding_of_rows_that_left(engine_and_model):
    engine, _ = engine_and_model
    engine.add(job("long", PROMPTS["a"], 1, prefix=list(range(30, 50))))
    engine.add(job("short", PROMPTS["b"], 3))
    engine.decode()  # both prefilled, 24 positions wide; "long" ends
    assert engine._attn.shape[1] == 24
    engine.decode()  # "short" alone: its 3 prompt positions and the token it was fed
    assert engine._attn.shape[1] == 4
    engine.abort_all()


def test_abort_frees_the_slot(engine_and_model):
    engine, _ = engine_and_model
    engine.add(job("a", PROMPTS["a"], 10))
    engine.add(job("b", PROMPTS["b"], 10))
    engine.decode()
    assert engine.abort("a") and engine.active == 1
    assert not engine.abort("a")
    events = engine.decode()
    assert [e.request_id for e in events] == ["b"]
    engine.abort_all()
    assert engine.active == 0


def test_stop_token_and_length_finish_reasons(engine_and_model):
    engine, model = engine_and_model
    first = reference(model, PROMPTS["a"], 1)[0]
    j = job("s", PROMPTS["a"], 5).replace(stop_token_ids=[first])
    engine.add(j)
    (ev,) = engine.decode()
    assert ev.finish_reason == "stop" and engine.active == 0
    engine.add(job("l", PROMPTS["a"], 1))
    (ev,) = engine.decode()
    assert ev.finish_reason == "length"


def test_sampling_is_seeded_by_request_and_position():
    logits = torch.randn(50)
    draws = {sample_token(logits, SamplingParams(), seed=3, position=p)[0] for p in range(30)}
    assert len(draws) > 1
    assert sample_token(logits, SamplingParams(), 3, 7) == sample_token(
        logits, SamplingParams(), 3, 7
    )
    token, logprob = sample_token(logits, SamplingParams(temperature=0.0), 0, 0)
    assert token == int(logits.argmax())
    assert logprob == pytest.approx(torch.log_softmax(logits, -1).max().item())


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([10.0, 9.0, -10.0, -10.0])
    seen = {
        sample_token(logits, SamplingParams(top_p=0.5), seed=s, position=0)[0] for s in range(50)
    }
    assert seen == {0}


def test_a_job_waits_for_room_in_a_bounded_kv_cache(tiny_model):
    """With `kv_cache_tokens`, the engine takes a job only while the running set, each grown
    to its whole budget, fits (rows x the longest); one larger than the bound runs alone."""
    engine = HFEngine(kv_cache_tokens=40)
    engine.load_weights(tiny_model)
    small = [job(f"s{i}", PROMPTS["a"], 6) for i in range(4)]  # 4 + 6 = 10 positions each
    for j in small:
        assert engine.fits(j)
        engine.add(j)
    extra = job("x", PROMPTS["b"], 5)
    assert not engine.fits(extra)  # 5 rows x 10 > 40
    wide = job("w", PROMPTS["c"], 44)  # 50 positions: more than the whole bound
    assert not engine.fits(wide)
    run_to_end(engine)
    assert engine.fits(extra) and engine.fits(wide)  # an empty engine takes anything
    engine.add(wide)
    assert not engine.fits(extra)


def test_an_unbounded_engine_fits_every_job(engine_and_model):
    engine, _ = engine_and_model
    assert engine.kv_cache_tokens is None and engine.fits(job("a", PROMPTS["a"], 10_000))


# ---- loading only the changed tensors ----
CHANGED = frozenset(
    {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.1.mlp.down_proj.weight",
    }
)


def copy_config(src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.fixture(scope="module")
def versions(tiny_model, tmp_path_factory):
    """v2: the tiny model with the CHANGED tensors moved (one shard, no index); changed_only:
    those tensors alone, in two shards with an index, and nothing else."""
    import json

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("versions")
    gen = torch.Generator().manual_seed(1)
    state = load_file(tiny_model / "model.safetensors")
    for name in CHANGED:
        state[name] = state[name] + 0.1 * torch.randn(state[name].shape, generator=gen)
    v2 = copy_config(tiny_model, root / "v2")
    save_file(state, v2 / "model.safetensors")
    only = copy_config(tiny_model, root / "changed_only")
    names = sorted(CHANGED)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    for shard, shard_names in shards.items():
        save_file({n: state[n] for n in shard_names}, only / shard)
    weight_map = {n: shard for shard, ns in shards.items() for n in ns}
    (only / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return v2, only


def loaded(folder, then=None, changed=None):
    engine = HFEngine()
    engine.load_weights(folder)
    if then is not None:
        engine.load_weights(then, changed)
    return engine


def test_loading_only_the_changed_tensors_equals_loading_the_whole_folder(tiny_model, versions):
    v2, changed_only = versions
    full = loaded(tiny_model, then=v2).model.state_dict()
    engine = loaded(tiny_model)
    engine.add(job("a", PROMPTS["a"], 4))
    engine.decode()
    engine.load_weights(changed_only, CHANGED)  # the other tensors are not in that folder
    partial = engine.model.state_dict()
    before = loaded(tiny_model).model.state_dict()
    assert full.keys() == partial.keys()
    for name in full:
        assert torch.equal(partial[name], full[name]), name
        assert torch.equal(partial[name], before[name]) == (name not in CHANGED), name
    assert engine.active == 0  # a load aborts what ran on the old weights


def test_an_empty_change_keeps_the_weights_and_aborts(tiny_model):
    engine = loaded(tiny_model)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.add(job("a", PROMPTS["a"], 4))
    engine.decode()
    engine.load_weights(tiny_model, frozenset())
    assert engine.active == 0 and engine._cache is None
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())


def test_a_changed_name_the_model_or_the_folder_lacks_is_refused(tiny_model, versions):
    engine = loaded(tiny_model)
    with pytest.raises(ValueError, match="model.layers.9"):
        engine.load_weights(tiny_model, frozenset({"model.layers.9.mlp.up_proj.weight"}))
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.load_weights(versions[1], frozenset({"model.norm.weight"}))


def test_tied_weights_follow_a_changed_embedding(tiny_model, versions, tmp_path):
    """A tied model's checkpoint has no lm_head: changing the embedding changes the head."""
    import json

    from safetensors.torch import load_file, save_file

    tied = copy_config(tiny_model, tmp_path / "tied")
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    state = load_file(tiny_model / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, tied / "model.safetensors")
    engine = loaded(tied, then=versions[1], changed=frozenset({"model.embed_tokens.weight"}))
    new = load_file(versions[1] / "model-00001-of-00002.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(engine.model.lm_head.weight, new)
    assert torch.equal(engine.model.model.embed_tokens.weight, new)


def test_whole_layers_widens_a_change_to_its_layers_tensors():
    from services.rollout.engines.tensors import layer_of, whole_layers

    names = [
        "lm_head.weight",
        "model.norm.weight",
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.experts.1.down_proj.weight",
    ]
    assert layer_of("model.layers.1.mlp.experts.1.down_proj.weight") == "model.layers.1.mlp.experts"
    assert whole_layers({"model.layers.0.self_attn.q_proj.weight"}, names) == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    }
    assert whole_layers({"model.layers.1.mlp.experts.0.up_proj.weight"}, names) == {
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.experts.1.down_proj.weight",
    }
    assert whole_layers({"lm_head.weight"}, names) == {"lm_head.weight"}
    assert whole_layers(set(), names) == set()


def test_weights_of_another_base_build_that_model_and_drop_the_running_requests(
    tiny_model, versions, tmp_path
):
    """A worker placed on a run on another base model (issue 52) loads that model's folder: the
    engine builds it anew (its shapes differ), and back; a version of the same model (v2) still
    loads in place."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model)
    config.hidden_size, config.intermediate_size = 32, 64
    torch.manual_seed(3)
    other_model = AutoModelForCausalLM.from_config(config).eval()
    other_model.save_pretrained(tmp_path / "other")
    engine = loaded(tiny_model)
    held = engine.model
    engine.add(job("a", PROMPTS["a"], 6))
    engine.decode()
    engine.load_weights(tmp_path / "other")
    assert engine.model is not held and engine.model.config.hidden_size == 32
    assert engine.active == 0  # what ran under the other model is not continued under this one
    out = run_to_end(engine, joins={0: [job("b", PROMPTS["b"], 4)]})
    assert out["b"] == reference(other_model, PROMPTS["b"], 4)
    engine.load_weights(tiny_model)
    assert engine.model.config.hidden_size == config_hidden(tiny_model)
    in_place = engine.model
    engine.load_weights(versions[0])  # a version of the model held: no new model
    assert engine.model is in_place


def config_hidden(folder):
    import json

    return json.loads((folder / "config.json").read_text())["hidden_size"]


def test_same_model_tells_another_base_from_a_version_of_the_one_held():
    held = {"embed.weight": (10, 4), "layer.0.w": (4, 4), "lm_head.weight": (10, 4)}
    assert same_model(held, {"embed.weight": (10, 4), "layer.0.w": (4, 4)})  # tied: left out
    assert same_model(held, dict(held))
    assert not same_model(held, {"embed.weight": (10, 8), "layer.0.w": (8, 8)})  # wider
    assert not same_model(held, {"embed.weight": (10, 4)})  # a layer fewer
    assert not same_model(held, held | {"layer.1.w": (4, 4)})  # a layer more

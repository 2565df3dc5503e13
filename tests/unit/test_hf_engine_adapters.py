"""LoRA in the transformers engine (issue 51): adapter versions held beside the base
(`engines/lora_rows.py`), requests of two versions in one batch under `max_staleness` 1, each
generating with its own version: its logprobs are those the trainer's model (peft, with that
version's adapter) gives the same tokens, and its tokens those it draws alone."""

import pytest
import torch

from services.rollout.engines.hf import HFEngine
from tests.factories import job
from tests.harness.lora import lora_of, tiny_qwen2

# peft's import alone takes seconds: in `make test`, not in `make test-fast`
pytestmark = pytest.mark.slow

PROMPTS = {"a": [1, 5, 9, 2], "b": [33, 17, 4], "c": [1, 5, 9, 2, 40, 41]}
TOKENS = 12


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(base folder, {version: adapter folder}, {version: the peft model}): two all-linear
    adapters (r 4, alpha 8) of one tiny base, random lora_B so each changes every layer."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora_rows")
    tiny_qwen2().save_pretrained(root / "base")
    folders, models = {}, {}
    for version, seed in ((1, 11), (2, 22)):
        models[version] = lora_of(root / "base", seed=seed)
        folders[version] = root / f"v{version}"
        models[version].save_pretrained(folders[version])
    return root / "base", folders, models


def engine_with(base, folders, max_adapters=4):
    engine = HFEngine(max_adapters=max_adapters)
    engine.load_weights(base)
    for version, folder in sorted(folders.items()):
        engine.hold_adapter(version, folder)
    return engine


def generate(engine, jobs_with_adapters):
    """Add every (job, adapter) before the first step, run to the end: each request's
    (tokens, logprobs)."""
    for j, adapter in jobs_with_adapters:
        engine.add(j, adapter=adapter)
    out: dict[str, tuple[list[int], list[float]]] = {}
    while engine.active:
        for ev in engine.decode():
            tokens, logprobs = out.setdefault(ev.request_id, ([], []))
            tokens.append(ev.token_id)
            logprobs.append(ev.logprob)
    return out


def trainer_logprobs(model, prompt, tokens):
    """The logprobs the trainer's model gives `tokens` after `prompt` (temperature 1)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1)[torch.arange(len(tokens)), tokens]


def test_two_versions_in_one_batch_each_with_its_own_adapter(saved):
    base, folders, models = saved
    engine = engine_with(base, folders, max_adapters=2)  # max_staleness 1: two versions
    plan = {  # request -> (prompt, adapter version), versions interleaved in the batch
        "1:0:0": ("a", 1),
        "2:0:0": ("a", 2),
        "1:1:0": ("b", 1),
        "2:1:0": ("c", 2),
        "2:2:0": ("b", 2),
    }
    jobs = {
        rid: job(rid, PROMPTS[p], TOKENS, temperature=1.0, seed=i, step=v)
        for i, (rid, (p, v)) in enumerate(plan.items())
    }
    out = generate(engine, [(jobs[rid], v) for rid, (_, v) in plan.items()])
    assert set(out) == set(plan)
    # the same prompt under the two versions: the adapters differ, so do the responses
    assert out["1:0:0"][0] != out["2:0:0"][0] or out["1:0:0"][1] != out["2:0:0"][1]
    for rid, (p, version) in plan.items():
        tokens, logprobs = out[rid]
        assert len(tokens) == TOKENS
        expected = trainer_logprobs(models[version], PROMPTS[p], tokens)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), rid
        # and the base alone gives other logprobs: the adapter is applied, not skipped
        with models[version].disable_adapter():
            base_only = trainer_logprobs(models[version], PROMPTS[p], tokens)
        assert not torch.allclose(torch.tensor(logprobs), base_only, atol=1e-3), rid
    # a request draws, in the mixed batch, the tokens it draws alone under its version
    for rid in ("1:1:0", "2:1:0"):
        alone = engine_with(base, {plan[rid][1]: folders[plan[rid][1]]})
        assert generate(alone, [(jobs[rid], None)])[rid][0] == out[rid][0]


def test_requests_keep_their_adapter_as_newer_ones_load(saved):
    """A request added under v1 goes on under v1 after v2 is loaded (newer requests take v2);
    past `max_adapters`, the oldest adapter no running request uses goes, and where every one
    is in use, a new one is refused with what to set."""
    base, folders, models = saved
    engine = engine_with(base, {1: folders[1]}, max_adapters=2)
    old = job("1:0:0", PROMPTS["a"], TOKENS, temperature=1.0, seed=3, step=1)
    engine.add(old)  # the newest adapter: v1
    out: dict[str, list[int]] = {}
    for ev in engine.decode():
        out.setdefault(ev.request_id, []).append(ev.token_id)
    engine.hold_adapter(2, folders[2])
    new = job("2:0:0", PROMPTS["b"], TOKENS, temperature=1.0, seed=4, step=2)
    engine.add(new)
    assert (engine.seqs["1:0:0"].adapter, engine.seqs["2:0:0"].adapter) == (1, 2)
    with pytest.raises(ValueError, match="in use by running requests.*SPOTRL_MAX_LORAS"):
        engine.hold_adapter(3, folders[1])
    while engine.active:
        for ev in engine.decode():
            out.setdefault(ev.request_id, []).append(ev.token_id)
    for rid, p, version in (("1:0:0", "a", 1), ("2:0:0", "b", 2)):
        lp = trainer_logprobs(models[version], PROMPTS[p], out[rid])
        alone = engine_with(base, {version: folders[version]})
        j = old if version == 1 else new
        assert generate(alone, [(j, None)])[rid][0] == out[rid], rid
        assert lp.shape == (TOKENS,)
    engine.hold_adapter(3, folders[1])  # nothing runs: the oldest (v1) goes
    assert list(engine.adapters.held) == [2, 3]
    with pytest.raises(ValueError, match="no adapter held for version 1"):
        engine.add(job("1:5:0", PROMPTS["a"], 2), adapter=1)


def test_an_adapter_that_does_not_fit_is_refused_and_a_whole_load_drops_adapters(saved, tmp_path):
    base, folders, _ = saved
    engine = engine_with(base, folders)
    other = tmp_path / "wide"
    tiny_qwen2(hidden_size=48).save_pretrained(tmp_path / "wide_base")
    lora_of(tmp_path / "wide_base", seed=1).save_pretrained(other)
    with pytest.raises(ValueError, match="base shape"):
        engine.hold_adapter(3, other)
    assert list(engine.adapters.held) == [1, 2]  # a refused adapter changes nothing
    dora = tmp_path / "dora"
    lora_of(base, seed=1, use_dora=True).save_pretrained(dora)
    with pytest.raises(ValueError, match="use_dora"):
        engine.hold_adapter(3, dora)
    engine.load_weights(base)  # new base weights: the adapters were of the old ones
    assert not engine.adapters.held
    engine.add(job("0:0:0", PROMPTS["a"], 2))
    assert engine.seqs["0:0:0"].adapter is None

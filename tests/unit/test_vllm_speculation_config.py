"""The vLLM engine's speculative settings, as vLLM is handed them (no engine started)."""

import os

import pytest

from services.rollout.engines.vllm import (
    VLLMOptions,
    VLLMUnavailable,
    intel_openmp_preload,
    spawn_environment,
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


def test_intel_openmp_replaces_gnu_openmp_once(monkeypatch, tmp_path):
    lib = tmp_path / "lib" / "libiomp5.so"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    monkeypatch.setattr("sys.prefix", str(tmp_path))
    # vLLM refuses both OpenMPs: the libgomp it preloaded for an earlier engine goes
    preload = intel_openmp_preload("/x/libtcmalloc.so:/t/libgomp-a1.so.1")
    assert preload == f"{lib}:/x/libtcmalloc.so"
    assert intel_openmp_preload(preload) is None


@pytest.mark.parametrize("before", [None, "/x/libtcmalloc.so"])
def test_the_preload_lasts_only_while_vllm_spawns(monkeypatch, before):
    """Whatever vLLM or we set while its processes start, later processes of this one start
    under the environment they had before (a leaked Intel OpenMP slowed a whole CI run)."""
    if before is None:
        monkeypatch.delenv("LD_PRELOAD", raising=False)
    else:
        monkeypatch.setenv("LD_PRELOAD", before)
    with spawn_environment("/y/libiomp5.so"):
        assert os.environ["LD_PRELOAD"] == "/y/libiomp5.so"
        os.environ["LD_PRELOAD"] = "/y/libiomp5.so:/t/libgomp.so.1"  # as vLLM does
    assert os.environ.get("LD_PRELOAD") == before
    with pytest.raises(RuntimeError), spawn_environment(None):
        os.environ["LD_PRELOAD"] = "/t/libgomp.so.1"
        raise RuntimeError("engine failed to start")
    assert os.environ.get("LD_PRELOAD") == before

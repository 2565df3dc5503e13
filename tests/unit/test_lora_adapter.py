"""The PEFT adapter format (services.weights.adapter) against peft itself: an adapter that peft
saved, merged into its base without peft, gives peft's merged weights and the peft model's
logits; what cannot be merged exactly is refused by name."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.weights.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    is_adapter,
    merged_tensors,
    read_adapter,
)
from tests.harness.lora import logits, lora_of, tiny_qwen2

# peft's import alone takes seconds: in `make test`, not in `make test-fast`
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(base folder, adapter folder, the peft model): an all-linear LoRA (r 4, alpha 8) whose
    lora_B weights are random, so that the adapter changes every weight it wraps."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora")
    tiny_qwen2().save_pretrained(root / "base")
    wrapped = lora_of(root / "base", seed=1)
    wrapped.save_pretrained(root / "adapter", safe_serialization=True)
    return root / "base", root / "adapter", wrapped


def test_merged_tensors_are_peft_merge_and_unload(saved):
    base, adapter, wrapped = saved
    assert is_adapter(adapter) and not is_adapter(base)
    merged = merged_tensors(base, adapter)
    # every Linear of the decoder layers is wrapped (all-linear leaves out lm_head)
    assert len(merged) == 2 * 7 and all(n.startswith("model.layers.") for n in merged)
    base_state = load_file(base / "model.safetensors")
    expected = logits(wrapped)
    reference = tiny_qwen2(seed=5)
    reference.load_state_dict(base_state)
    state = reference.state_dict()
    with torch.no_grad():
        for name, tensor in merged.items():
            assert tensor.dtype == base_state[name].dtype
            assert not torch.equal(tensor, base_state[name]), name
            state[name].copy_(tensor)
    peft_merged = wrapped.merge_and_unload().state_dict()  # changes `wrapped`: last
    for name, tensor in merged.items():
        assert torch.allclose(tensor, peft_merged[name], atol=1e-6), name
    assert torch.allclose(logits(reference), expected, atol=1e-5)


def test_a_sharded_base_is_read_by_its_index(saved, tmp_path):
    base, adapter, _ = saved
    state = load_file(base / "model.safetensors")
    names = sorted(state)
    half = len(names) // 2
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for shard, shard_names in shards.items():
        save_file({n: state[n] for n in shard_names}, sharded / shard)
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    whole = merged_tensors(base, adapter)
    split = merged_tensors(sharded, adapter)
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[n], split[n]) for n in whole)


def test_rslora_scales_by_the_root_of_r(saved, tmp_path):
    _, adapter, _ = saved
    copy = tmp_path / "rslora"
    shutil.copytree(adapter, copy)
    config = json.loads((copy / ADAPTER_CONFIG).read_text())
    (copy / ADAPTER_CONFIG).write_text(json.dumps(config | {"use_rslora": True}))
    assert read_adapter(adapter).scaling == 8 / 4
    assert read_adapter(copy).scaling == 8 / 2


def edited(adapter: Path, dest: Path, config=None, drop=(), add=None) -> Path:
    """A copy of `adapter` with its config updated by `config`, the tensors named in `drop`
    left out and those in `add` put in."""
    shutil.copytree(adapter, dest)
    if config:
        cfg = json.loads((dest / ADAPTER_CONFIG).read_text())
        (dest / ADAPTER_CONFIG).write_text(json.dumps(cfg | config))
    tensors = load_file(dest / ADAPTER_WEIGHTS)
    tensors = {k: v for k, v in tensors.items() if k not in drop} | (add or {})
    save_file(tensors, dest / ADAPTER_WEIGHTS)
    return dest


Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"config": {"use_dora": True}}, "use_dora"),
        ({"config": {"rank_pattern": {"q_proj": 8}}}, "rank_pattern"),
        ({"config": {"alpha_pattern": {"q_proj": 16}}}, "alpha_pattern"),
        ({"drop": (f"{Q}.lora_B.weight",)}, r"q_proj\.weight: its lora_B weight is missing"),
        ({"add": {f"{Q}.bias": torch.zeros(32)}}, r"q_proj\.bias: not a lora_A or lora_B"),
        (
            {"add": {"base_model.model.lm_head.modules_to_save.default.weight": torch.zeros(1)}},
            "modules_to_save",
        ),
    ],
)
def test_what_cannot_be_merged_exactly_is_refused(saved, tmp_path, change, refusal):
    base, adapter, _ = saved
    bad = edited(adapter, tmp_path / "bad", **change)
    with pytest.raises(ValueError, match=refusal):
        merged_tensors(base, bad)


def test_a_weight_the_base_lacks_or_does_not_fit_is_named(saved, tmp_path):
    base, adapter, _ = saved
    ghost = "base_model.model.model.layers.9.self_attn.q_proj"
    lacking = edited(
        adapter,
        tmp_path / "lacking",
        add={
            f"{ghost}.lora_A.weight": torch.zeros(4, 32),
            f"{ghost}.lora_B.weight": torch.zeros(32, 4),
        },
    )
    with pytest.raises(
        ValueError, match=r"lacks: \['model\.layers\.9\.self_attn\.q_proj\.weight'\]"
    ):
        merged_tensors(base, lacking)
    misfit = edited(
        adapter,
        tmp_path / "misfit",
        add={f"{Q}.lora_A.weight": torch.zeros(4, 16), f"{Q}.lora_B.weight": torch.zeros(32, 4)},
    )
    with pytest.raises(
        ValueError, match=r"q_proj\.weight: base shape \(32, 32\), adapter B @ A \(32, 16\)"
    ):
        merged_tensors(base, misfit)

"""LoRA on the policy (issue 51), on the tiny model with peft: only the adapter trains, the KL
reference is the base (the adapter disabled, no copy), version 0 is the base's folder and later
versions the adapter alone, a checkpoint holds the adapter and its optimizer state and resumes
exactly, and an adapter version loads back into another trainer."""

import json

import pytest
import torch
from safetensors.torch import load

from services.contracts.runspec import RunSpec
from services.trainer.export import write_files
from services.trainer.policy import Policy
from services.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tests.unit.test_policy_knobs import knobs, make_groups

# peft's import alone takes seconds: in `make test`, not in `make test-fast`
pytestmark = pytest.mark.slow


def lora_spec(tiny_model, **over) -> RunSpec:
    return knobs(tiny_model, lora_r=4, lora_alpha=8, learning_rate=1e-2, **over)


def adapter_tensors(policy: Policy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in policy.adapter.trainable_state().items()}


def base_tensors(policy: Policy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in policy.adapter.base_tensors().items()}


def train_step(policy: Policy) -> None:
    policy.accumulate(make_groups(policy))
    policy.optimizer_step()


def test_only_the_adapter_trains_and_the_reference_is_the_base(tiny_model):
    policy = Policy(tiny_model, lora_spec(tiny_model, beta=0.1))
    assert policy.ref is None  # no second copy of the model
    trained = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    optimized = {id(p) for g in policy.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in policy.model.parameters() if p.requires_grad}
    base, adapter = base_tensors(policy), adapter_tensors(policy)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = policy.model(input_ids=ids).logits
    train_step(policy)
    train_step(policy)
    assert all(torch.equal(v, base[k]) for k, v in policy.adapter.base_tensors().items())
    after = adapter_tensors(policy)
    assert any(not torch.equal(after[k], adapter[k]) for k in adapter)
    with torch.no_grad():
        moved = policy.model(input_ids=ids).logits
        with policy.adapter.disabled():
            reference = policy.model(input_ids=ids).logits
    assert not torch.allclose(moved, before)
    assert torch.allclose(reference, before)  # the base, as it was before training


def test_version_0_is_the_base_and_later_versions_the_adapter(tiny_model):
    policy = Policy(tiny_model, lora_spec(tiny_model))
    full = Policy(tiny_model, RunSpec(model=str(tiny_model)))
    train_step(policy)
    v0, v1 = policy.export_files(0), policy.export_files(1)
    assert v0 == full.export_files(0)  # the base's folder, named as its own files
    assert set(v1) == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    config = json.loads(v1[ADAPTER_CONFIG])
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert len(v1[ADAPTER_WEIGHTS]) < 0.2 * sum(map(len, v0.values()))
    keys = load(v1[ADAPTER_WEIGHTS]).keys()
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in keys)


def test_an_adapter_version_loads_into_another_trainer(tiny_model, tmp_path):
    policy = Policy(tiny_model, lora_spec(tiny_model))
    train_step(policy)
    folder = write_files(policy.export_files(1), tmp_path / "v1")
    other = Policy(tiny_model, lora_spec(tiny_model, seed=3))
    other.load_weights(folder)
    mine, theirs = adapter_tensors(policy), adapter_tensors(other)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    # version 0's folder puts the adapter back at its start: the model is its base
    other.load_weights(write_files(policy.export_files(0), tmp_path / "v0"))
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        with other.adapter.disabled():
            base = other.model(input_ids=ids).logits
        assert torch.equal(other.model(input_ids=ids).logits, base)


def test_a_checkpoint_holds_the_adapter_and_resumes_exactly(tiny_model, tmp_path):
    spec = lora_spec(tiny_model)
    policy = Policy(tiny_model, spec)
    train_step(policy)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    policy.snapshot(folder)()
    state = torch.load(folder / "state.pt", weights_only=False)
    assert state["model"].keys() == policy.adapter.trainable_state().keys()  # no base weights
    resumed = Policy(tiny_model, lora_spec(tiny_model, seed=5))
    resumed.restore(folder)
    train_step(policy)
    train_step(resumed)
    a, b = adapter_tensors(policy), adapter_tensors(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the adapter and its Adam moments came back

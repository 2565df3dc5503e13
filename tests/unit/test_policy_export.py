"""Published weights are written in the run's dtype, so bytes moved are not doubled."""

import torch
from safetensors import safe_open

from services.contracts.runspec import RunSpec
from services.trainer.policy import Policy


def sizes_and_dtypes(folder):
    files = sorted(folder.glob("*.safetensors"))
    dtypes = set()
    for f in files:
        with safe_open(f, "pt") as fh:
            dtypes |= {fh.get_tensor(k).dtype for k in fh.keys()}  # noqa: SIM118
    return sum(f.stat().st_size for f in files), dtypes


def test_export_writes_the_requested_dtype(tiny_model, tmp_path):
    fp32 = Policy(tiny_model, RunSpec(model=str(tiny_model), weight_dtype="auto"))
    size32, dt32 = sizes_and_dtypes(fp32.export(tmp_path / "a"))
    bf16 = Policy(tiny_model, RunSpec(model=str(tiny_model), weight_dtype="bfloat16"))
    size16, dt16 = sizes_and_dtypes(bf16.export(tmp_path / "b"))
    assert dt32 == {torch.float32} and dt16 == {torch.bfloat16}  # auto is fp32 on CPU
    assert size16 < 0.55 * size32
    assert (tmp_path / "b" / "tokenizer.json").is_file()


def test_bf16_weights_load_into_the_engine(tiny_model, tmp_path):
    from services.rollout.engines.hf import HFEngine

    folder = Policy(tiny_model, RunSpec(model=str(tiny_model), weight_dtype="bfloat16")).export(
        tmp_path / "w"
    )
    engine = HFEngine()
    engine.load_weights(tiny_model)
    engine.load_weights(folder)  # a reload from bf16 files into the fp32 engine
    assert next(engine.model.parameters()).dtype == torch.float32


def test_weights_exported_in_memory_are_the_folder_a_loader_reads(tiny_model, tmp_path):
    """A version is uploaded from memory: the same files, bytes and content digest as the
    folder, which loads back into a policy with the same weights."""
    import asyncio

    from services.trainer.export import weight_files
    from services.weights.files import hash_files, scan_folder

    policy = Policy(tiny_model, RunSpec(model=str(tiny_model)))
    files = policy.export_files(0)
    folder = policy.export(tmp_path / "v")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    assert asyncio.run(hash_files(files)).digest == asyncio.run(scan_folder(folder)).digest
    other = Policy(tiny_model, RunSpec(model=str(tiny_model), seed=1))
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(1.0)
    other.load_weights(folder)
    for a, b in zip(policy.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # a model bigger than a shard is written as numbered shards and their index
    tensors = {k: v.detach() for k, v in policy.model.state_dict().items()}
    sharded = weight_files(tensors, limit=max(t.numel() * 4 for t in tensors.values()))
    assert "model.safetensors.index.json" in sharded and "model.safetensors" not in sharded
    assert len(sharded) > 2

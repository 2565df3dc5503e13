"""Published weights are written in the run's dtype, so bytes moved are not doubled."""

import torch
from safetensors import safe_open

from services.common.runspec import RunSpec
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

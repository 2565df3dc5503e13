"""Shared fixtures: a tiny base model built once per session."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A small untied Qwen2 model for the arithmetic task, briefly pre-trained."""
    import torch

    from services.trainer.init_model import InitModelSpec, init_model

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("models") / "tiny"
    spec = InitModelSpec(hidden_size=64, layers=2, heads=2, pretrain_steps=40, batch_size=64)
    return init_model(out, spec)


def require_vllm():
    """Skip where vLLM is not installed; in CI (`make test` installs it) its absence fails."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must test the vllm engine, but vllm does not import: {exc}")
        pytest.skip(f"vllm not installed (make setup-vllm): {exc}")

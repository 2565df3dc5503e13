"""Shared fixtures: a tiny base model built once per session. Every test under tests/integration,
tests/compose, tests/swarm (real processes, real Redis, Docker) and tests/chart (the Helm chart,
rendered by helm) is marked `slow` here, at collection: `make test-fast` (-m "not slow") runs the
unit tests only."""

import os
from pathlib import Path

import pytest

SLOW_FOLDERS = {"integration", "compose", "chart", "swarm"}

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


def make_job(rid, prompt, n, prefix=(), temperature=0.0, seed=1, lease=0, stop=()):
    """A token-level job for engine tests: continue `prompt + prefix` for `n` tokens."""
    from services.contracts.messages import Job
    from services.contracts.sampling import SamplingParams

    return Job(
        run_id="r",
        request_id=rid,
        lease=lease,
        version=0,
        prompt_ids=list(prompt),
        prefix_ids=list(prefix),
        remaining_tokens=n,
        sampling=SamplingParams(temperature=temperature),
        seed=seed,
        stop_token_ids=list(stop),
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FOLDERS & set(Path(str(item.fspath)).relative_to(Path(__file__).parent).parts):
            item.add_marker(pytest.mark.slow)

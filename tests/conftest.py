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


def make_job(rid, prompt, n, prefix=(), temperature=0.0, seed=1, lease=0, stop=(), grant="g"):
    """A token-level job for engine tests: continue `prompt + prefix` for `n` tokens."""
    from services.contracts.messages import Job
    from services.contracts.sampling import SamplingParams

    return Job(
        run_id="r",
        request_id=rid,
        lease=lease,
        grant=grant,
        version=0,
        prompt_ids=list(prompt),
        prefix_ids=list(prefix),
        remaining_tokens=n,
        sampling=SamplingParams(temperature=temperature),
        seed=seed,
        stop_token_ids=list(stop),
    )


def granted(table, msg):
    """`msg` (a DeltaItem or a RequestLease) as the worker that holds its request's lease in
    `table` sends it: with that lease's grant. A message under another lease (or of a request
    not in the table) is left as it is."""
    r = table.requests.get(msg.request_id)
    return msg.replace(grant=r.grant) if r is not None and r.lease == msg.lease else msg


def granted_batch(table, batch):
    """A DeltaBatch whose deltas and releases carry their leases' grants in `table`."""
    return batch.replace(
        items=[granted(table, i) for i in batch.items],
        released=[granted(table, r) for r in batch.released],
    )


def apply(table, item, version=None):
    """`table.apply` of a delta sent by the worker that holds its lease."""
    return table.apply(granted(table, item), version)


def apply_all(table, items, version=None):
    """`table.apply_all` of deltas sent by the workers that hold their leases."""
    return table.apply_all([granted(table, i) for i in items], version)


def apply_held(table, batches, rules):
    """`collect.apply_batches` of batches sent by the workers that hold their leases (as the
    table's leases stand before the first)."""
    from services.core.collect import apply_batches

    return apply_batches(table, [granted_batch(table, b) for b in batches], rules)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FOLDERS & set(Path(str(item.fspath)).relative_to(Path(__file__).parent).parts):
            item.add_marker(pytest.mark.slow)

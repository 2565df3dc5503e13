"""One engine serving several runs at once (issue 52, `engines/shared.py`): LoRA runs on one
base, each run's requests under its own adapter and its own request ids, in one batch."""

import asyncio

import pytest
import redis.asyncio as aioredis
import torch

from services.rollout.context import worker_shared
from services.rollout.control import Control
from services.rollout.engines.hf import HFEngine
from services.rollout.engines.shared import SharedEngine
from services.rollout.flusher import Flusher
from services.rollout.generation import Generator
from services.rollout.settings import RolloutSettings
from tests.factories import job
from tests.harness.lora import lora_of, tiny_qwen2

RUNS = ("run-a", "run-b", "run-c")


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A base, and an adapter of it per run (its own seed)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("shared")
    tiny_qwen2().save_pretrained(root / "base")
    for i, run in enumerate(RUNS):
        lora_of(root / "base", seed=i + 1).save_pretrained(root / run, safe_serialization=True)
    return root


def jobs_of(run: str) -> list:
    """The same request ids in every run (ids are per run), sampled at temperature 1."""
    return [
        job(f"0:{p}:0", [3 + p, 7, 11], 12, temperature=1.0, seed=100 + p, run_id=run)
        for p in range(3)
    ]


async def alone(published, run: str) -> dict[str, list[int]]:
    """What the run's requests draw on an engine of their own."""
    engine = HFEngine(max_adapters=2)
    engine.load_weights(published / "base")
    engine.hold_adapter(1, published / run)
    for j in jobs_of(run):
        engine.add(j)
    out: dict[str, list[int]] = {}
    while engine.active:
        for event in engine.decode():
            out.setdefault(event.request_id, []).append(event.token_id)
    return out


async def together(published) -> dict[str, dict[str, list[int]]]:
    """Every run's requests on one engine, in one batch."""
    shared = SharedEngine(HFEngine(max_adapters=2 * len(RUNS)))
    for run in RUNS:
        view = shared.view(run)
        await view.load_base(published / "base", "digest-of-the-base")
        await view.load_adapter(1, published / run)
        for j in jobs_of(run):
            view.add(j)
    assert shared.active == 3 * len(RUNS)
    out: dict[str, dict[str, list[int]]] = {}
    while shared.active:
        for run, events in (await shared.step()).items():
            for event in events:
                out.setdefault(run, {}).setdefault(event.request_id, []).append(event.token_id)
    assert all(shared.view(run).active == 0 for run in RUNS)
    return out


def test_runs_in_one_batch_draw_what_each_draws_alone(published):
    got = asyncio.run(together(published))
    for run in RUNS:
        expected = asyncio.run(alone(published, run))
        assert got[run] == expected, run
    # the adapters differ, so the runs' tokens do: each request ran under its own run's
    assert got["run-a"] != got["run-b"]


def test_a_run_loads_its_base_once_and_its_own_weights_only_alone(published):
    async def scenario() -> None:
        engine = HFEngine(max_adapters=4)
        shared = SharedEngine(engine)
        a, b = shared.view("run-a"), shared.view("run-b")
        await a.load_base(published / "base", "d1")
        await a.load_adapter(1, published / "run-a")
        a.add(jobs_of("run-a")[0])
        await b.load_base(published / "base", "d1")  # the same content: nothing loaded
        assert a.active == 1 and engine.active == 1
        with pytest.raises(ValueError, match="other runs are served"):
            await b.load_base(published / "base", "d2")  # another base: not beside run-a
        with pytest.raises(ValueError, match="other runs are served"):
            await b.load(published / "base")
        await b.load_adapter(1, published / "run-b")
        b.add(jobs_of("run-b")[0])
        # the same request id in both runs: two requests
        assert a.abort("0:0:0") and a.active == 0 and b.active == 1
        shared.close_view("run-a")  # the worker no longer serves run-a
        assert engine.active == 1
        await b.load(published / "base")  # alone now: its whole weights load, its requests stop
        assert shared.base is None and engine.active == 0 and b.active == 0

    asyncio.run(scenario())


def test_a_run_keeps_its_adapter_while_others_load_theirs(published):
    """The engine holds 2 adapters: run-b's next version makes room from run-b's own older
    one, never from the one run-a adds its requests under (though no request of run-a runs
    now); a third run finds no room and is refused."""

    async def scenario() -> None:
        engine = HFEngine(max_adapters=2)
        shared = SharedEngine(engine)
        a, b, c = shared.view("run-a"), shared.view("run-b"), shared.view("run-c")
        await a.load_base(published / "base", "d")
        await a.load_adapter(1, published / "run-a")
        await b.load_adapter(1, published / "run-b")
        await b.load_adapter(2, published / "run-c")
        assert set(engine.adapters.held) == {
            shared.adapter_id("run-a", 1),
            shared.adapter_id("run-b", 2),
        }
        a.add(jobs_of("run-a")[0])  # under its adapter, still held
        b.add(jobs_of("run-b")[0])
        assert shared.active == 2
        with pytest.raises(ValueError, match="in use"):
            await c.load_adapter(1, published / "run-c")
        assert c.newest is None and shared.adapter_id("run-c", 1) is None

    asyncio.run(scenario())


def test_a_run_at_its_base_beside_runs_with_adapters_draws_from_the_base(published):
    """A LoRA run's version 0 is its base: its requests run under no adapter, though the
    engine holds other runs' (and `Engine.add` with none names the newest)."""

    async def scenario() -> dict[str, list[int]]:
        shared = SharedEngine(HFEngine(max_adapters=2))
        a, b = shared.view("run-a"), shared.view("run-b")
        await b.load_base(published / "base", "d")
        await b.load_adapter(1, published / "run-b")
        await a.load_base(published / "base", "d")  # run-a at version 0: nothing loaded
        for j in jobs_of("run-a"):
            a.add(j)
        for j in jobs_of("run-b"):
            b.add(j)
        out: dict[str, list[int]] = {}
        while shared.active:
            for event in (await shared.step()).get("run-a", []):
                out.setdefault(event.request_id, []).append(event.token_id)
        return out

    base = HFEngine()
    base.load_weights(published / "base")
    for j in jobs_of("run-a"):
        base.add(j)
    expected: dict[str, list[int]] = {}
    while base.active:
        for event in base.decode():
            expected.setdefault(event.request_id, []).append(event.token_id)
    assert asyncio.run(scenario()) == expected


def test_a_run_starts_no_job_while_another_runs_load_holds_the_engine(published):
    """The generation task starts a run's jobs under `engine_lock`: a load of another run
    awaits midway (a vLLM engine restarting with LoRA holds no engine then), and a job started
    meanwhile would land in an engine half loaded."""

    async def scenario() -> None:
        settings = RolloutSettings(worker_id="w", flush_tokens=4096, flush_ms=60000)
        w = worker_shared(settings, aioredis.Redis(), HFEngine(max_adapters=4))
        lane = w.lane("run-b")
        await lane.engine.load_base(published / "base", "d")
        lane.version = 0
        generator = Generator(w, Control(w))
        generator.serve(lane, Flusher(lane))
        lane.inbox.put(b"1-0", jobs_of("run-b")[0])
        async with w.engine_lock:  # run-a's load, midway
            admitting = asyncio.create_task(generator.round())
            await asyncio.sleep(0.1)
            assert lane.engine.active == 0 and len(lane.inbox) == 1
        await admitting
        assert lane.engine.active == 1 and len(lane.inbox) == 0

    asyncio.run(scenario())

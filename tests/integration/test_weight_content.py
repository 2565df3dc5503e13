"""Runs over the same base model share its files in the weight store (issue 51): a client that
commits a version whose files the store holds committed already (another run's version 0)
names them instead of sending them, and the store links them: one copy on disk, the bytes of
each run's version verified as ever. A file that differs is sent."""

import asyncio
import os

import httpx

from services.weights.transfer import WeightClient
from tests.integration.conftest import start_store

RECEIVED = "spotrl_weightstore_bytes_received_total"


def received(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(RECEIVED))


def test_a_second_run_over_the_same_base_uploads_none_of_it(tmp_path):
    store = start_store(tmp_path / "store")
    try:
        base = tmp_path / "base"
        base.mkdir()
        (base / "config.json").write_text('{"run": "a"}')
        (base / "model.safetensors").write_bytes(os.urandom(3_000_000))
        asyncio.run(WeightClient([store.url]).upload_folder(base, "run-a", 0))
        before = received(store.url)
        (base / "config.json").write_text('{"run": "b"}')  # one file differs
        manifest = asyncio.run(WeightClient([store.url]).upload_folder(base, "run-b", 0))
        sent = received(store.url) - before
        assert sent == len('{"run": "b"}'), sent  # the config only, not the 3 MB
        data = tmp_path / "store" / "data"
        a, b = (data / run / "v00000000" / "model.safetensors" for run in ("run-a", "run-b"))
        assert os.stat(a).st_ino == os.stat(b).st_ino  # one copy on disk
        assert {f.name for f in manifest.files} == {"config.json", "model.safetensors"}
        pulled = asyncio.run(WeightClient([store.url]).pull("run-b", 0, tmp_path / "pulled"))
        for name in ("config.json", "model.safetensors"):
            assert (pulled.folder / name).read_bytes() == (base / name).read_bytes()
    finally:
        store.stop()

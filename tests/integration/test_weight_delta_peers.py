"""Peers serve the deltas of the versions they made from deltas (issue 42), with a real
weight-store process and a real Redis; the workers are `services.rollout.peers.Peers`
instances in this process (their block servers on their own threads and ports, as a rollout
worker runs them), pulling with the worker's WeightClient and swarm.

A worker that made a version from deltas keeps the delta beside the version's files and
announces the version whole; the next worker takes that delta from it, not from the store.
A peer whose copy of the delta rotted on disk is refused by the manifest's sha256, and the
store serves the delta instead: the version is exact either way."""

import asyncio
import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import redis
import torch
from safetensors.torch import save

from services.contracts import keys
from services.infra.redis_streams import connect
from services.rollout.peers import Peers
from services.rollout.settings import RolloutSettings
from services.weights.contract import Manifest
from services.weights.files import hash_files_now
from services.weights.transfer import PullResult, WeightClient
from tests.integration.conftest import start_store

RUN = "delta-peers-run"
WEIGHTS = "model.safetensors"
DELTA = f"{WEIGHTS}.delta"
CONFIG = b'{"dtype": "bfloat16"}'


def two_versions(mib: int = 4) -> tuple[bytes, bytes]:
    """A bf16 safetensors file of `mib` MiB and the same with 1% of its values changed."""
    rng = np.random.default_rng(7)
    values = rng.integers(0, 1 << 15, size=mib << 19, dtype=np.uint16)
    first = save({"w": torch.from_numpy(values.copy()).view(torch.bfloat16)})
    values[rng.integers(0, values.size, size=values.size // 100)] ^= 1
    return first, save({"w": torch.from_numpy(values).view(torch.bfloat16)})


def holding(r: redis.Redis, worker: str) -> str | None:
    """What `worker` announced it holds of v1 ("all", or a hex bit set of blocks)."""
    raw = r.hget(keys.weight_holders(RUN, 1), worker)
    return None if raw is None else json.loads(raw)["blocks"]


def exact(got: PullResult, weights: bytes) -> None:
    assert (got.folder / WEIGHTS).read_bytes() == weights
    assert (got.folder / "config.json").read_bytes() == CONFIG


def test_peers_serve_the_deltas_they_applied(tmp_path, empty_redis_url, caplog):
    versions = two_versions()
    store = start_store(tmp_path / "s")
    r = redis.Redis.from_url(empty_redis_url)
    peers = {
        name: Peers(RolloutSettings(worker_id=name, redis_url=empty_redis_url))
        for name in ("a", "b")
    }
    caplog.set_level(logging.INFO, logger="services.weights.delta_pull")

    async def scenario() -> None:
        uploader = WeightClient([store.url], deltas=True)
        manifests: list[Manifest] = []
        for v, weights in enumerate(versions):
            local = hash_files_now({WEIGHTS: weights, "config.json": CONFIG})
            manifests.append(await uploader.upload(local, RUN, v))
        entry = manifests[1].entry(WEIGHTS)
        assert entry is not None and entry.delta is not None and entry.delta.base == 0
        delta = entry.delta
        ar = connect(empty_redis_url)
        try:
            client = WeightClient([store.url], deltas=True)

            async def pull(worker: str, v: int, dest: str, reuse: Path | None) -> PullResult:
                swarm = peers[worker].swarm(ar, RUN, v)
                folder = tmp_path / worker / dest
                got = await client.pull(RUN, v, folder, reuse=reuse, swarm=swarm)
                exact(got, versions[v])
                return got

            # A: v0 whole from the store, then v1 as the store's delta of v0
            a0 = await pull("a", 0, "v0", None)
            a1 = await pull("a", 1, "v1", a0.folder)
            assert a1.deltas == 1 and a1.from_peers == 0 and a1.bytes == delta.size
            kept = a1.folder / DELTA
            assert hashlib.sha256(kept.read_bytes()).hexdigest() == delta.sha256
            assert holding(r, "a") == "all"

            # B: v0, then v1's delta from A, not from the store
            b0 = await pull("b", 0, "v0", None)
            b1 = await pull("b", 1, "v1", b0.folder)
            assert b1.deltas == 1
            assert b1.from_peers == b1.bytes == delta.size > 0, (b1.from_peers, b1.bytes)
            assert (b1.folder / DELTA).read_bytes() == kept.read_bytes()
            assert holding(r, "b") == "all"

            # A's copy of the delta rots: B, pulling v1 again, refuses it and takes the store's
            rotted = bytearray(kept.read_bytes())
            rotted[len(rotted) // 2] ^= 0x10
            kept.write_bytes(bytes(rotted))
            caplog.clear()
            b2 = await pull("b", 1, "v1-again", b0.folder)
            assert b2.deltas == 1 and b2.from_peers == 0 and b2.bytes == delta.size
            assert hashlib.sha256((b2.folder / DELTA).read_bytes()).hexdigest() == delta.sha256
            assert not (tmp_path / "b" / "v1-again.partial").exists()
            assert f"from peer {peers['a'].url}" in caplog.text, caplog.text
            assert "sha256 mismatch" in caplog.text, caplog.text
        finally:
            await ar.aclose()

    try:
        asyncio.run(scenario())
    finally:
        for p in peers.values():
            p.stop()
        r.close()
        store.stop()

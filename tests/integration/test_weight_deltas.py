"""Sparse weight deltas (issue 42) with real weight-store processes and real clients: versions
pulled as deltas are bit-identical to full pulls; a corrupted delta and a delta against the
wrong base are refused and the version is pulled in full; a joiner starts from the last full
version; a store killed (between commits, and in the middle of a delta commit) and a puller
killed while applying deltas leave nothing partial to list, serve or load.

The versions are made as an RL step at a small learning rate makes them: fp32 master weights
moved by AdamW-like updates of about `LR`, exported as bf16, where most values do not change
from one version to the next."""

import asyncio
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import save

from services.cli import procs
from services.cli.client import CoordinatorClient
from services.weights.contract import Manifest, WeightTransferError
from services.weights.files import COMPLETE, hash_files_now, read_complete
from services.weights.transfer import PullResult, WeightClient
from tests.harness.deploy import Deployment, DeploymentConfig
from tests.integration import conftest
from tests.integration.conftest import small_spec, wait_final, wait_until

LR = 1e-6
WEIGHTS = "model.safetensors"
REFUSED = "spotrl_weight_deltas_refused_total"


# a weight store on a folder (the same folder on a restart): a full file every 8 versions
start_store = functools.partial(conftest.start_store, full_every=8, keep_versions=30)


def rl_versions(count: int, elements: int = 1 << 20, seed: int = 0) -> list[bytes]:
    """`count` bf16 safetensors files of two weight matrices and a norm, each the one before
    after an AdamW step of learning rate LR (fp32 master weights, random gradients)."""
    gen = torch.Generator().manual_seed(seed)
    side = int(elements**0.5)
    master = {
        "embed.weight": torch.randn(side, side, generator=gen) * 0.02,
        "mlp.weight": torch.randn(side, side, generator=gen) * 0.02,
        "norm.weight": torch.ones(side),
    }
    moments = {k: (torch.zeros_like(t), torch.zeros_like(t)) for k, t in master.items()}
    files = []
    for step in range(1, count + 1):
        files.append(save({k: t.to(torch.bfloat16) for k, t in master.items()}))
        for name, weight in master.items():
            grad = torch.randn(weight.shape, generator=gen)
            m, v = moments[name]
            m.mul_(0.9).add_(grad, alpha=0.1)
            v.mul_(0.999).addcmul_(grad, grad, value=0.001)
            m_hat, v_hat = m / (1 - 0.9**step), v / (1 - 0.999**step)
            weight.mul_(1 - LR * 0.01).sub_(LR * m_hat / (v_hat.sqrt() + 1e-8))
    return files


def version_files(weights: bytes):
    return hash_files_now({WEIGHTS: weights, "config.json": b'{"dtype": "bfloat16"}'})


def same_files(folder: Path, weights: bytes) -> None:
    assert (folder / WEIGHTS).read_bytes() == weights
    assert (folder / "config.json").read_bytes() == b'{"dtype": "bfloat16"}'


def refused() -> float:
    return REGISTRY.get_sample_value(REFUSED) or 0.0


@pytest.fixture(scope="module")
def versions() -> list[bytes]:
    return rl_versions(20)


def test_twenty_versions_pulled_as_deltas_equal_full_pulls(tmp_path, versions):
    store = start_store(tmp_path / "s", full_every=5)
    uploader = WeightClient([store.url], deltas=True)
    by_deltas = WeightClient([store.url], deltas=True)
    in_full = WeightClient([store.url], deltas=False)

    async def run() -> tuple[list[PullResult], list[PullResult], list[Manifest]]:
        deltas, fulls, manifests, held = [], [], [], None
        for v, weights in enumerate(versions):
            local = version_files(weights)
            manifest = await uploader.upload(local, "m", v)
            got = await by_deltas.pull(
                "m",
                v,
                tmp_path / f"d{v}",
                expect_digest=local.digest,
                reuse=held,
                manifest=manifest,
            )
            full = await in_full.pull("m", v, tmp_path / f"f{v}", expect_digest=local.digest)
            same_files(got.folder, weights)
            same_files(full.folder, weights)
            assert got.digest == full.digest == local.digest
            deltas.append(got)
            fulls.append(full)
            manifests.append(manifest)
            held = got.folder
        return deltas, fulls, manifests

    try:
        deltas, fulls, manifests = asyncio.run(run())
    finally:
        store.stop()
    assert [r.deltas for r in deltas] == [0] + [1] * 19
    assert all(r.deltas == 0 for r in fulls)
    for manifest in manifests[1:]:  # every later version went up as a delta of the one before
        entry = manifest.entry(WEIGHTS)
        assert entry is not None and entry.delta is not None
        assert entry.delta.base == manifest.version - 1
    moved, whole = sum(r.bytes for r in deltas[1:]), sum(r.bytes for r in fulls[1:])
    assert moved < 0.25 * whole, (moved, whole)
    for got in deltas[1:]:  # the tensors that changed are named: the norm never moves at LR
        assert got.changed is not None and "norm.weight" not in got.changed
        assert got.changed <= {"embed.weight", "mlp.weight"}


def upload_all(store: procs.Proc, versions: list[bytes], model: str = "m") -> WeightClient:
    uploader = WeightClient([store.url], deltas=True)

    async def run() -> None:
        for v, weights in enumerate(versions):
            await uploader.upload(version_files(weights), model, v)

    asyncio.run(run())
    return uploader


def test_a_corrupted_delta_is_refused_and_the_version_pulled_in_full(tmp_path, versions):
    store = start_store(tmp_path / "s")
    try:
        upload_all(store, versions[:2])
        client = WeightClient([store.url], deltas=True)
        held = asyncio.run(client.pull("m", 0, tmp_path / "v0"))
        delta = tmp_path / "s" / "data" / "m" / "v00000001" / f"{WEIGHTS}.delta"
        data = bytearray(delta.read_bytes())
        data[len(data) // 2] ^= 0x01
        delta.write_bytes(bytes(data))
        before = refused()
        got = asyncio.run(client.pull("m", 1, tmp_path / "v1", reuse=held.folder))
    finally:
        store.stop()
    assert refused() == before + 1
    assert got.deltas == 0 and got.bytes >= len(versions[1])
    same_files(got.folder, versions[1])


def test_a_delta_against_the_wrong_base_is_refused(tmp_path, versions):
    """The held folder holds other bytes than its marker says (a file changed on disk), or its
    marker names another version than the one its files are: the delta does not apply to
    them, and the version is pulled in full."""
    store = start_store(tmp_path / "s")
    try:
        upload_all(store, versions[:3])
        client = WeightClient([store.url], deltas=True)
        held = asyncio.run(client.pull("m", 0, tmp_path / "v0")).folder
        held = asyncio.run(client.pull("m", 1, tmp_path / "v1", reuse=held)).folder
        v0_marker = read_complete(tmp_path / "v0")

        changed = tmp_path / "changed"
        os.rename(held, changed)  # v1's marker, another file on disk
        (changed / WEIGHTS).write_bytes(versions[0])
        before = refused()
        got = asyncio.run(client.pull("m", 2, tmp_path / "a", reuse=changed))
        assert refused() == before + 1 and got.deltas == 0
        same_files(got.folder, versions[2])

        # v2's files under v0's marker: 0 -> 1 -> 2 applied to them. (v1's files would not do:
        # the delta 0 -> 1 applied to its own target makes that target, rightly accepted.)
        misnamed = tmp_path / "misnamed"
        misnamed.mkdir()
        (misnamed / WEIGHTS).write_bytes(versions[2])
        (misnamed / "config.json").write_bytes(b'{"dtype": "bfloat16"}')
        (misnamed / COMPLETE).write_text(json.dumps(v0_marker))
        before = refused()
        got = asyncio.run(client.pull("m", 2, tmp_path / "b", reuse=misnamed))
        assert refused() == before + 1 and got.deltas == 0
        same_files(got.folder, versions[2])
    finally:
        store.stop()


def test_a_joiner_at_v13_starts_from_the_last_full_version(tmp_path, versions):
    store = start_store(tmp_path / "s", full_every=5)
    try:
        upload_all(store, versions[:14])
        got = asyncio.run(WeightClient([store.url], deltas=True).pull("m", 13, tmp_path / "j"))
    finally:
        store.stop()
    assert got.deltas == 3  # v10 in full, then the deltas of 11, 12, 13
    assert got.changed is None  # from a version it did not hold
    same_files(got.folder, versions[13])
    stored = tmp_path / "s" / "data" / "m"
    for v in (10, 11, 12):
        folder = stored / f"v{v:08d}"
        kept_whole = (folder / WEIGHTS).is_file()
        assert kept_whole == (v == 10), v  # v11, v12 are thinned to their deltas
        assert (folder / f"{WEIGHTS}.delta").is_file()
    assert (stored / f"v{13:08d}" / WEIGHTS).is_file()  # the newest is kept whole too
    assert not (tmp_path / "j.base").exists()


def big_versions(count: int, mib: int) -> list[bytes]:
    """`count` bf16 safetensors files of `mib` MiB, each with 1% of its values changed from
    the one before (random bit patterns: only the bytes matter here)."""
    rng = np.random.default_rng(1)
    values = rng.integers(0, 1 << 15, size=mib << 19, dtype=np.uint16)
    files = []
    for _ in range(count):
        files.append(save({"w": torch.from_numpy(values.copy()).view(torch.bfloat16)}))
        at = rng.integers(0, values.size, size=values.size // 100)
        values[at] ^= 1
    return files


def listed(store: procs.Proc) -> list[int]:
    return asyncio.run(WeightClient([store.url]).versions("m"))


def test_store_killed_between_delta_commits_keeps_deltas_working(tmp_path, versions):
    """kill -9 of the store between two delta commits, restarted on the same folder: the
    clients that were using it (the uploader, a puller holding a version) go on with deltas,
    and every pull gives the exact files."""
    root = tmp_path / "s"
    store = start_store(root)
    port = int(store.url.rsplit(":", 1)[1])
    uploader = WeightClient([store.url], deltas=True)
    puller = WeightClient([store.url], deltas=True)

    def upload(v: int) -> Manifest:
        return asyncio.run(uploader.upload(version_files(versions[v]), "m", v))

    def pull(v: int, held: Path | None) -> PullResult:
        got = asyncio.run(puller.pull("m", v, tmp_path / f"p{v}", reuse=held))
        same_files(got.folder, versions[v])
        return got

    try:
        upload(0)
        upload(1)
        held = pull(0, None).folder
        store.kill()
        store = start_store(root, port)
        assert listed(store) == [0, 1]
        before = refused()
        got = pull(1, held)
        second = upload(2)  # a delta commit after the restart
        entry = second.entry(WEIGHTS)
        assert entry is not None and entry.delta is not None and entry.delta.base == 1
        assert pull(2, got.folder).deltas == 1
        assert got.deltas == 1 and refused() == before, "the first delta pull after the restart"
    finally:
        store.stop()


def test_store_killed_mid_delta_commit_lists_and_serves_nothing_partial(tmp_path):
    """kill -9 of the store while it applies an uploaded delta at commit (a 256 MiB file:
    seconds of work): the cut-off version is not committed, not listed nor served after the
    restart on the same folder, its staging is gone, and the same version committed again as
    a delta is pulled as one, exact."""
    files = big_versions(4, 256)
    root = tmp_path / "s"
    store = start_store(root)
    port = int(store.url.rsplit(":", 1)[1])
    uploader = WeightClient([store.url], deltas=True)

    def upload(v: int) -> None:
        asyncio.run(uploader.upload(version_files(files[v]), "m", v))

    try:
        upload(0)
        upload(1)
        staging = root / "data" / "m" / "staging"
        failed: list[BaseException] = []

        def cut_off() -> None:
            try:
                upload(2)
            except WeightTransferError as exc:
                failed.append(exc)

        uploading = threading.Thread(target=cut_off)
        uploading.start()
        # at commit the store writes the file it made from the delta aside, then commits
        wait_until(
            lambda: any(staging.rglob(f".{WEIGHTS}.part")) or not uploading.is_alive(),
            "the commit never began",
            120,
            0.002,
        )
        landed = uploading.is_alive()
        store.kill()
        uploading.join(60)
        assert landed, "the upload was over before the kill"
        assert failed, "an upload cut off mid-commit reported success"
        assert listed_now(root) == [0, 1]  # nothing of v2 is committed, even on disk
        store = start_store(root, port)
        assert listed(store) == [0, 1]
        assert not any(p.is_file() for p in staging.rglob("*")), "the cut-off staging stayed"
        with pytest.raises(WeightTransferError):
            asyncio.run(WeightClient([store.url]).pull("m", 2, tmp_path / "nope", attempts=1))
        assert not (tmp_path / "nope").exists()
        upload(2)  # again, after the restart: a delta of v1 still
        puller = WeightClient([store.url], deltas=True)
        held = asyncio.run(puller.pull("m", 1, tmp_path / "v1")).folder
        got = asyncio.run(puller.pull("m", 2, tmp_path / "v2", reuse=held))
    finally:
        store.stop()
    assert got.deltas == 1
    same_files(got.folder, files[2])


def listed_now(root: Path) -> list[int]:
    """The versions committed on disk (a folder with its manifest)."""
    folder = root / "data" / "m"
    return sorted(int(p.name[1:]) for p in folder.glob("v*") if (p / "manifest.json").is_file())


PULLER = """
import asyncio, sys
from pathlib import Path
from services.weights.transfer import WeightClient
url, version, dest, held = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
got = asyncio.run(WeightClient([url], deltas=True).pull("m", version, dest, reuse=held))
print(got.deltas, got.bytes)
"""


def test_puller_killed_mid_apply_leaves_no_version_folder(tmp_path):
    """A process pulling a 256 MiB version as a delta of the one it holds, SIGKILLed once it
    is applying it (its `.partial` folder is there): no folder of that version exists, and a
    pull again gives the exact files."""
    files = big_versions(2, 256)
    store = start_store(tmp_path / "s")
    try:
        upload_all(store, files)
        held = asyncio.run(WeightClient([store.url]).pull("m", 0, tmp_path / "v0")).folder
        dest = tmp_path / "v1"
        partial = dest.with_name("v1.partial")
        puller = subprocess.Popen(
            [sys.executable, "-c", PULLER, store.url, "1", str(dest), str(held)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(
                lambda: partial.exists() or puller.poll() is not None,
                "the pull never began",
                120,
                0.002,
            )
            puller.send_signal(signal.SIGKILL)
            puller.wait(30)
        finally:
            if puller.poll() is None:
                puller.kill()
        out = puller.stdout.read() if puller.stdout else ""
        assert puller.returncode == -signal.SIGKILL, f"it finished before the kill: {out}"
        assert not dest.exists() and partial.exists()
        again = asyncio.run(WeightClient([store.url], deltas=True).pull("m", 1, dest, reuse=held))
    finally:
        store.stop()
    assert again.deltas == 1
    same_files(again.folder, files[1])
    assert not partial.exists()


def delta_run(tmp_path: Path, tiny_model: Path, steps: int) -> tuple[DeploymentConfig, dict]:
    """A deployment (one worker, every version kept) and a run whose versions go as deltas:
    bf16 weights at a learning rate of LR, and a reward some samples of a group get and some
    do not (any number 0..100 in the response), so every step moves some weights."""
    rows = [{"a": 10 + i, "b": 3 * i, "answer": "50"} for i in range(8)]
    sums = tmp_path / "sums.jsonl"
    sums.write_text("".join(json.dumps(row) + "\n" for row in rows))
    keep = {"SPOTRL_KEEP_VERSIONS": str(steps + 1)}
    config = DeploymentConfig(tmp_path, reserved=1, preemptible=0, worker_slots=16, extra_env=keep)
    spec = small_spec(
        tiny_model,
        task="dataset",
        dataset=str(sums),
        prompt_template="{a}+{b}=",
        reward="numeric_match",
        reward_tolerance=50.0,
        steps=steps,
        learning_rate=LR,
        weight_dtype="bfloat16",
        group_size=8,
    )
    return config, spec


def check_loaded_last(dep: Deployment, run_id: str, worker: str = "rollout-reserved-1") -> int:
    """The folder the worker loaded last is byte for byte a full pull of its version (which
    it returns), beside the deltas that made it."""
    cache = dep.work_dir / "rollout" / worker / run_id
    last = max(int(p.name[1:]) for p in cache.glob("v*") if p.name[1:].isdigit())
    store = WeightClient(dep.weightstore_urls)
    manifest = asyncio.run(store.manifest(run_id, last))
    full = asyncio.run(store.pull(run_id, last, dep.work_dir / "full"))
    assert read_complete(cache / f"v{last}")["version"] == last
    names = {e.name for e in manifest.files}
    held = {p.name for p in (cache / f"v{last}").iterdir()}
    assert names <= held and held - names <= {COMPLETE} | manifest.delta_names(), held
    for name in names:
        assert (cache / f"v{last}" / name).read_bytes() == (full.folder / name).read_bytes()
    return last


def listdir(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def delta_loads(dep: Deployment, run_id: str, worker: str = "rollout-reserved-1") -> list[int]:
    """The versions the worker's log says it loaded from deltas (its "loaded" lines)."""
    text = (dep.log_dir / f"{worker}.log").read_text()
    pattern = rf"loaded {run_id} v(\d+) \(\d+ bytes.*made from the deltas"
    return [int(v) for v in re.findall(pattern, text)]


def test_a_run_loads_its_versions_as_deltas(tmp_path, tiny_model):
    """A real run of 20 steps: the trainer commits the versions as deltas, the worker loads
    them as deltas (bytes far below the version's), and the folder it loaded last is byte for
    byte a full pull of that version."""
    steps = 20
    config, spec = delta_run(tmp_path, tiny_model, steps)
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        run_id = client.submit(spec)
        run = wait_final(client, dep, run_id)
        assert run["state"] == "succeeded", run
        store = WeightClient(dep.weightstore_urls)
        manifests = {v: asyncio.run(store.manifest(run_id, v)) for v in range(1, steps + 1)}
        check_loaded_last(dep, run_id)
        worker_log = (dep.log_dir / "rollout-reserved-1.log").read_text()
        from_deltas = delta_loads(dep, run_id)
    by_delta = [m for m in manifests.values() if any(f.delta is not None for f in m.files)]
    assert len(by_delta) >= steps // 2, "the trainer committed few versions as deltas"
    loaded = {
        int(v): int(n) for v, n in re.findall(rf"loaded {run_id} v(\d+) \((\d+) bytes", worker_log)
    }
    small = [v for v, n in loaded.items() if v > 0 and n < manifests[v].total_bytes() / 4]
    assert len(small) >= steps // 2, loaded
    assert set(from_deltas) >= set(small), (from_deltas, small)


def test_trainer_killed_mid_run_with_deltas(tmp_path, tiny_model):
    """The trainer SIGKILLed mid-run, its versions going as deltas: the store lists only
    whole versions (each pulls in full, checked), the restarted trainer commits its later
    versions as deltas again, the worker takes deltas after the restart too, and the folder
    it loaded last is byte for byte its version."""
    steps = 12
    config, spec = delta_run(tmp_path, tiny_model, steps)
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        run_id = client.submit(spec)
        store = WeightClient(dep.weightstore_urls)
        wait_until(lambda: 4 in asyncio.run(store.versions(run_id)), "v4 never committed", 120)
        dep.procs["trainer"].kill()
        killed_at = asyncio.run(store.versions(run_id))[-1]
        dep.restart("trainer", kill=True)
        run = wait_final(client, dep, run_id)
        assert run["state"] == "succeeded", run
        assert killed_at < steps  # it was killed mid-run
        versions = asyncio.run(store.versions(run_id))
        assert versions == list(range(steps + 1))
        for v in versions:  # every version listed is whole: each pulls in full, checked
            asyncio.run(store.pull(run_id, v, tmp_path / "all" / str(v)))
        manifests = [asyncio.run(store.manifest(run_id, v)) for v in versions]
        check_loaded_last(dep, run_id)
        from_deltas = delta_loads(dep, run_id)
    after = [m.version for m in manifests[6:] if any(f.delta for f in m.files)]
    assert after, "the restarted trainer committed no version as a delta"
    assert any(v > 6 for v in from_deltas), from_deltas

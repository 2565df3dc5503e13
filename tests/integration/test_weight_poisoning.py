"""No weight poisoning, with real processes: a version committed by someone else before the
trainer commits it fails the run and is never loaded; a foreign version announced by hand is
refused by the workers; the weight client tells our own earlier commit from a foreign one, and
the trainer after a restart takes a version from the store only with the digest it recorded."""

import asyncio
import shutil
import time

import pytest
import redis.asyncio as aioredis
from safetensors.torch import load_file, save_file

from services.cli import procs
from services.contracts import keys
from services.state.run_state import RunStopped
from services.trainer.loop import TrainerLoop
from services.trainer.settings import TrainerSettings
from services.weights.contract import Manifest, manifest_digest
from services.weights.transfer import (
    WeightClient,
    WeightConflict,
    WeightTransferError,
    scan_folder,
)
from tests.harness.deploy import DeploymentConfig

from .conftest import deploy_config, small_spec, wait_final

WORKER = "rollout-preemptible-1"


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    # a slow engine: a step's rollout takes seconds, so a foreign upload made as soon as the
    # step's version is announced lands before the trainer commits the next one
    return deploy_config(
        tmp_path_factory.mktemp("poison"),
        reserved=0,
        flush_tokens=1,
        extra_env={"SPOTRL_STEP_DELAY_MS": "500"},
    )


def spec(model) -> dict:
    return small_spec(
        model, steps=4, prompts_per_step=2, group_size=2, max_new_tokens=6, ignore_eos=True
    )


def foreign_copy(model, dest):
    """The base model with one tensor changed: a plausible but foreign version."""
    shutil.copytree(model, dest)
    path = dest / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, path, metadata={"format": "pt"})
    return dest


def wait_for(what: str, check, deployment, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        deployment.check_alive()
        if got := check():
            return got
        time.sleep(0.05)
    raise TimeoutError(f"{what} not seen in {timeout_s}s")


def version_of(rdb, run_id) -> int | None:
    raw = rdb.get(keys.run_version(run_id))
    return int(raw) if raw is not None else None


def loaded_versions(rdb, run_id) -> set[int]:
    return {int(v) for v in rdb.smembers(keys.worker_loads(run_id, WORKER))}


def log_of(deployment, name: str) -> str:
    return (deployment.log_dir / f"{name}.log").read_text()


def commit_foreign(deployment, folder, run_id, version) -> str:
    """Upload and commit `folder` as `version` of the run; its content digest."""
    client = WeightClient(deployment.weightstore_urls)
    try:
        manifest = asyncio.run(client.upload_folder(folder, run_id, version))
    except WeightConflict as exc:  # the trainer won the race: the engine was not slow enough
        pytest.fail(f"the trainer committed v{version} before the foreign upload: {exc}")
    assert manifest.version == version
    return asyncio.run(scan_folder(folder)).digest


def test_foreign_version_committed_first_fails_the_run(
    deployment, client, rdb, tiny_model, tmp_path
):
    foreign = foreign_copy(tiny_model, tmp_path / "foreign")
    run_id = client.submit(spec(tiny_model))
    wait_for("version 1", lambda: version_of(rdb, run_id) == 1, deployment)
    commit_foreign(deployment, foreign, run_id, 2)

    run = wait_final(client, deployment, run_id)
    assert run["state"] == "failed", run
    assert "weight version 2" in run["error"] and "committed by someone else" in run["error"]
    assert "!= ours" in run["error"]
    assert version_of(rdb, run_id) == 1  # never announced
    assert loaded_versions(rdb, run_id) == {0, 1}
    worker_log = log_of(deployment, WORKER)
    assert f"loaded {run_id} v1" in worker_log and f"loaded {run_id} v2" not in worker_log
    trainer_log = log_of(deployment, "trainer")
    assert "committed by someone else" in trainer_log
    assert "took it" not in trainer_log and "version 2 committed" not in trainer_log
    events = [e for _, e in rdb.xrange(keys.run_events(run_id))]
    assert any(b"committed by someone else" in e[b"e"] for e in events)


def test_foreign_version_announced_by_hand_is_refused(
    deployment, client, rdb, tiny_model, tmp_path
):
    folder = foreign_copy(tiny_model, tmp_path / "foreign")
    run_id = client.submit(spec(tiny_model))
    wait_for("version 1", lambda: version_of(rdb, run_id) == 1, deployment)
    foreign = commit_foreign(deployment, folder, run_id, 2)
    refusals = f"refusing {run_id} v2"

    def refused(n: int):
        return lambda: log_of(deployment, WORKER).count(refusals) >= n

    rdb.set(keys.run_version(run_id), 2)  # announced with no digest at all ...
    rdb.hdel(keys.run_digests(run_id), 2)  # (nor the trainer's own, if it got that far)
    wait_for("a refusal", refused(1), deployment)
    before = log_of(deployment, WORKER).count(refusals)
    rdb.hset(keys.run_digests(run_id), 2, "0" * 64)  # ... then with a digest it does not have
    wait_for("a refusal of the mismatch", refused(before + 1), deployment)

    log = log_of(deployment, WORKER)
    assert "was announced without a digest" in log
    assert f"is not the one announced (digest {foreign[:16]} != announced {'0' * 16})" in log
    assert f"loaded {run_id} v2" not in log
    assert 2 not in loaded_versions(rdb, run_id)
    if client.run(run_id)["state"] not in ("failed", "cancelled"):
        client.cancel(run_id)
    wait_final(client, deployment, run_id)
    assert 2 not in loaded_versions(rdb, run_id)


# ---- the weight client against real weight-store processes ----


@pytest.fixture
def stores(tmp_path):
    started = []
    for name in ("a", "b"):
        port = procs.free_port()
        env = {"SPOTRL_PORT": str(port), "SPOTRL_ROOT": str(tmp_path / name / "data")}
        started.append(
            procs.start_service(f"ws-{name}", "services.weightstore.main", env, tmp_path, port)
        )
    try:
        procs.wait_healthy(started, 60)
        yield started
    finally:
        for proc in started:
            proc.stop()


def folder_with(path, payload: bytes):
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(payload)
    return path


def test_client_tells_our_earlier_commit_from_a_foreign_one(stores, tmp_path):
    a, b = (p.url for p in stores)
    ours = folder_with(tmp_path / "ours", b"ours" * 1000)
    theirs = folder_with(tmp_path / "theirs", b"them" * 1000)
    ours_digest = asyncio.run(scan_folder(ours)).digest
    theirs_digest = asyncio.run(scan_folder(theirs)).digest

    both = WeightClient([a, b])
    first = asyncio.run(both.upload_folder(ours, "m", 0))
    again = asyncio.run(both.upload_folder(ours, "m", 0))  # our own earlier attempt: fine
    assert first.files == again.files
    with pytest.raises(WeightConflict, match="committed by someone else") as err:
        asyncio.run(both.upload_folder(theirs, "m", 0))
    assert err.value.stored == ours_digest and err.value.expected == theirs_digest
    assert asyncio.run(both.stored_digest("m", 0)) == ours_digest
    assert asyncio.run(both.stored_digest("m", 7)) is None

    # replica a has a foreign v1, b ours: a pull expecting ours skips a, downloading nothing
    asyncio.run(WeightClient([a]).upload_folder(theirs, "m", 1))
    asyncio.run(WeightClient([b]).upload_folder(ours, "m", 1))
    got = asyncio.run(both.pull("m", 1, tmp_path / "pulled", expect_digest=ours_digest))
    assert got.digest == ours_digest
    assert (got.folder / "model.safetensors").read_bytes() == b"ours" * 1000
    # a cached folder is reused only with the digest expected
    with pytest.raises(WeightConflict, match="not the one announced"):
        asyncio.run(WeightClient([b]).pull("m", 1, got.folder, expect_digest=theirs_digest))
    assert not (tmp_path / "pulled").exists() and not (tmp_path / "pulled.partial").exists()
    with pytest.raises(WeightConflict):
        asyncio.run(WeightClient([a]).pull("m", 1, tmp_path / "a-only", expect_digest=ours_digest))
    assert not (tmp_path / "a-only").exists() and not (tmp_path / "a-only.partial").exists()

    # a manifest that names another version than the one asked for is refused
    on_b = tmp_path / "b" / "data" / "m" / "v00000001" / "manifest.json"
    on_b.write_text(on_b.read_text().replace('"version": 1', '"version": 5'))
    with pytest.raises(WeightTransferError, match="names"):
        asyncio.run(WeightClient([b]).pull("m", 1, tmp_path / "renamed", attempts=1))


# ---- the trainer's commit and resume rules, against real Redis and a real weight store ----


class WeightsOnly:
    """The part of the trainer's policy that these rules touch: its weights as one file."""

    def __init__(self, payload: bytes) -> None:
        self.payload, self.loaded = payload, None

    def export_files(self, version: int = 0) -> dict[str, bytes]:
        return {"model.safetensors": self.payload}

    def export(self, folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(self.payload)
        return folder

    def load_weights(self, folder) -> None:
        self.loaded = (folder / "model.safetensors").read_bytes()


def test_trainer_takes_only_its_own_earlier_commit(stores, redis_url, tmp_path):
    url = stores[0].url
    run_id = "r-poison-rules"
    settings = TrainerSettings(redis_url=redis_url, weightstore_url=url, work_dir=tmp_path / "t")

    async def scenario() -> None:
        r = aioredis.from_url(redis_url)
        digests = keys.run_digests(run_id)
        await r.hset(keys.run(run_id), mapping={"state": "running"})
        # v1 committed, then a crash before its announce; the restarted trainer re-trains
        # other weights, finds its own recorded commit in the store and takes it
        await TrainerLoop(settings, r).versions.commit(run_id, WeightsOnly(b"one"), 1)
        loop = TrainerLoop(settings, r)
        retrained = WeightsOnly(b"one, again")
        await loop.versions.commit(run_id, retrained, 1)
        assert retrained.loaded == b"one"
        await loop.versions.announce(run_id, 1)
        # taken, not committed by this trainer: announced without a manifest (pulls ask)
        assert not await r.hexists(keys.run_manifests(run_id), 1)
        for version in (2, 3):
            await loop.versions.commit(run_id, WeightsOnly(b"%d" % version), version)
            await loop.versions.announce(run_id, version)
        assert int(await r.get(keys.run_version(run_id))) == 3
        assert sorted(int(v) for v in await r.hkeys(digests)) == [2, 3]  # trimmed
        assert (await r.hget(digests, 3)).decode() == await loop.weights.stored_digest(run_id, 3)
        # the store's manifest of each version it committed is announced with it
        manifests = keys.run_manifests(run_id)
        assert sorted(int(v) for v in await r.hkeys(manifests)) == [2, 3]  # trimmed
        announced = Manifest.model_validate_json(await r.hget(manifests, 3))
        assert manifest_digest(announced) == (await r.hget(digests, 3)).decode()

        # resuming from the store takes only the content recorded for the version
        await r.hset(digests, 3, "0" * 64)
        with pytest.raises(RunStopped):
            await loop.versions.take(run_id, WeightsOnly(b""), 3)
        run = await r.hgetall(keys.run(run_id))
        assert run[b"state"] == b"failed" and b"is not the one announced" in run[b"error"]

        # a foreign v4 in the store before the trainer's commit fails the run
        await r.hset(keys.run(run_id), mapping={"state": "running", "error": ""})
        foreign = WeightsOnly(b"foreign").export(tmp_path / "foreign")
        await WeightClient([url]).upload_folder(foreign, run_id, 4)
        with pytest.raises(RunStopped, match="committed by someone else"):
            await loop.versions.commit(run_id, WeightsOnly(b"4"), 4)
        run = await r.hgetall(keys.run(run_id))
        assert run[b"state"] == b"failed" and b"!= ours" in run[b"error"]
        await r.aclose()

    asyncio.run(scenario())

"""Weight transfer with real weight-store processes: a corrupted file is refused and fetched
from another replica, a weight store killed in the middle of a pull is retried until the whole
version is there, and a worker that joins in the middle of a step serves that step."""

import asyncio
import logging
import os
import signal
import time

import pytest
import redis

from services.cli.client import CoordinatorClient
from services.contracts import keys
from services.contracts.messages import Heartbeat
from services.weights.transfer import WeightClient, WeightTransferError
from tests.harness.deploy import Deployment, DeploymentConfig
from tests.integration.conftest import small_spec, start_store, wait_final, wait_until


def make_folder(path, size):
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(os.urandom(size))
    return path


def test_corrupt_file_is_refused_and_fetched_from_another_replica(tmp_path):
    a, b = start_store(tmp_path / "a"), start_store(tmp_path / "b")
    try:
        src = make_folder(tmp_path / "src", 3_000_000)
        asyncio.run(WeightClient([a.url, b.url]).upload_folder(src, "m", 0))
        on_a = tmp_path / "a" / "data" / "m" / "v00000000" / "model.safetensors"
        data = bytearray(on_a.read_bytes())
        data[1000] ^= 0xFF
        on_a.write_bytes(bytes(data))

        with pytest.raises(WeightTransferError, match="sha256"):
            asyncio.run(WeightClient([a.url]).pull("m", 0, tmp_path / "only-a", attempts=1))
        assert not (tmp_path / "only-a").exists()  # nothing half-done is left to load

        result = asyncio.run(WeightClient([a.url, b.url]).pull("m", 0, tmp_path / "dst"))
        got = (result.folder / "model.safetensors").read_bytes()
        assert got == (src / "model.safetensors").read_bytes()
    finally:
        a.stop()
        b.stop()


def test_pull_survives_the_weight_store_dying_mid_transfer(tmp_path, caplog):
    root = tmp_path / "ws"
    store = start_store(root)
    port = int(store.url.rsplit(":", 1)[1])
    size = 300_000_000
    src = make_folder(tmp_path / "src", size)
    client = WeightClient([store.url], parallel=2)
    asyncio.run(client.upload_folder(src, "m", 0))
    asyncio.run(client.pull("m", 0, tmp_path / "warm"))

    async def until(condition, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.002)

    def written(path) -> int:
        """Bytes on disk so far (the pull writes into a sparse file of the full size)."""
        try:
            return path.stat().st_blocks * 512
        except FileNotFoundError:
            return 0

    async def pull_while_killing(dest):
        task = asyncio.create_task(client.pull("m", 0, dest, attempts=30))
        part = dest.with_name(dest.name + ".partial") / "model.safetensors"
        await until(lambda: task.done() or 0 < written(part) < size // 2, "the pull never began")
        store.kill()
        # down until the pull has seen it fail, then back on the same port and disk
        await until(lambda: task.done() or "failed" in caplog.text, "the pull never failed")
        restarted = await asyncio.to_thread(start_store, root, port)
        return await task, restarted

    caplog.set_level(logging.WARNING, logger="services.weights.transfer")
    for attempt in range(3):  # the kill has to land while bytes are moving
        dest = tmp_path / f"dst{attempt}"
        result, store = asyncio.run(pull_while_killing(dest))
        if "failed" in caplog.text:
            break
    try:
        assert "failed" in caplog.text, "the kill never landed during a transfer"
        assert (result.folder / "model.safetensors").read_bytes() == (
            src / "model.safetensors"
        ).read_bytes()
    finally:
        store.stop()


def generated_on(r, worker_id: str, version: int) -> bool:
    """The worker's heartbeat says it holds `version` and has generated tokens."""
    raw = r.get(keys.worker_heartbeat(worker_id))
    beat = Heartbeat.decode(raw) if raw else None
    return beat is not None and beat.version == version and beat.tokens_generated > 0


def test_worker_joining_mid_step_serves_that_step(tmp_path, tiny_model):
    # a heartbeat that outlives the early worker's pause below: it is not declared dead
    env = {"SPOTRL_STEP_DELAY_MS": "40", "SPOTRL_HEARTBEAT_TTL_S": "120"}
    with Deployment(
        DeploymentConfig(
            tmp_path, reserved=0, preemptible=1, worker_slots=4, flush_tokens=2, extra_env=env
        )
    ) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        r = redis.Redis.from_url(dep.redis_url)
        spec = small_spec(
            tiny_model,
            steps=1,
            prompts_per_step=4,
            group_size=4,
            max_new_tokens=32,
            ignore_eos=True,
        )
        run_id = client.submit(spec)
        early = dep.procs["rollout-preemptible-1"]
        wait_until(  # it took its first jobs of step 0 (4 slots: 12 jobs still wait)...
            lambda: (
                any(
                    c["pending"] > 0
                    for c in r.xinfo_consumers(keys.jobs_stream(run_id, 0), keys.WORKERS_GROUP)
                )
                if r.exists(keys.jobs_stream(run_id, 0))
                else False
            ),
            "the first worker took no job of step 0",
        )
        early.popen.send_signal(signal.SIGSTOP)  # ...and step 0 cannot end before the late one
        try:
            late = dep.add_worker("preemptible")  # joins while step 0 is generating
            wait_until(
                lambda: r.sismember(keys.worker_loads(run_id, late.name), 0),
                "the late worker never loaded version 0",
            )
            # tokens generated while it holds version 0, which cannot end while the first worker
            # is stopped: it serves the step it joined in
            wait_until(
                lambda: generated_on(r, late.name, version=0), "the late worker never served step 0"
            )
        finally:
            early.popen.send_signal(signal.SIGCONT)
        run = wait_final(client, dep, run_id)
        assert run["state"] == "succeeded"
        assert r.sismember(keys.worker_loads(run_id, late.name), 0)


def test_a_run_survives_losing_one_of_two_weight_store_replicas(tmp_path, tiny_model):
    with Deployment(
        DeploymentConfig(tmp_path, reserved=0, preemptible=2, weightstores=2, worker_slots=8)
    ) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        r = redis.Redis.from_url(dep.redis_url)
        # steps to spare: one worker may be slow to load v0 (a busy CI machine) while the
        # other serves a few steps, and each must still load a version after the kill
        spec = small_spec(tiny_model, steps=10, prompts_per_step=4, group_size=3)
        run_id = client.submit(spec)
        workers = ("rollout-preemptible-1", "rollout-preemptible-2")

        def loads(worker: str) -> set[int]:
            return {int(v) for v in r.smembers(keys.worker_loads(run_id, worker))}

        wait_until(lambda: all(0 in loads(w) for w in workers), "a worker never loaded v0", 120)
        dep.procs.pop("weightstore-2").kill()  # the trainer and workers carry on with the other
        killed_at = int(r.get(keys.run_version(run_id)) or 0)
        assert killed_at < spec["steps"] - 2, f"the run was at v{killed_at} before the kill"
        run = wait_final(client, dep, run_id)
        assert run["state"] == "succeeded" and run["groups_incomplete"] == 0
        # every step's version was served, and each worker pulled a version published after
        # the replica died (a worker whose load is slow may skip a version the other worker
        # has already served: it loads the newest, so "every worker loads every version" is
        # not a rule)
        assert set().union(*(loads(w) for w in workers)) >= set(range(spec["steps"]))
        for worker in workers:
            assert max(loads(worker)) > killed_at, (worker, loads(worker), killed_at)


def manifest_gets(store) -> float:
    """How many manifests the store served, from its own /metrics."""
    import httpx

    text = httpx.get(f"{store.url}/metrics").text
    (line,) = [
        x for x in text.splitlines() if x.startswith("spotrl_weightstore_manifests_served_total ")
    ]
    return float(line.rsplit(" ", 1)[1])


def test_a_pull_with_the_announced_manifest_asks_the_store_for_none(tmp_path):
    """The trainer announces the manifest the store answered its commit with: a worker pulls
    the version with it and asks the store for the files only. A manifest that is not of the
    announced digest is not used: the store's own is asked for, and the pull is the same."""
    from services.weights.contract import manifest_digest

    store = start_store(tmp_path / "s")
    try:
        src = make_folder(tmp_path / "src", 100_000)
        client = WeightClient([store.url])
        manifest = asyncio.run(client.upload_folder(src, "m", 0))
        digest = manifest_digest(manifest)
        before = manifest_gets(store)
        got = asyncio.run(
            client.pull("m", 0, tmp_path / "a", expect_digest=digest, manifest=manifest)
        )
        assert got.digest == digest and manifest_gets(store) == before
        other = manifest.model_copy(update={"files": manifest.files[:1]})
        got = asyncio.run(client.pull("m", 0, tmp_path / "b", expect_digest=digest, manifest=other))
        assert got.digest == digest and manifest_gets(store) == before + 1
        src_bytes = (src / "model.safetensors").read_bytes()
        assert (got.folder / "model.safetensors").read_bytes() == src_bytes
    finally:
        store.stop()

"""Peer-to-peer weight fan-out with real processes: a weight store, Redis, and pullers that pull
a version the way a rollout worker does and serve it to their peers (services.rollout.peer_pull),
or real rollout workers in a run. A peer SIGKILLed in the middle of serving, and a peer serving
a corrupted block: the puller ends with the verified version all the same, nothing partial."""

import asyncio
import functools
import json
import os
import re
import sys

import redis

from services.cli import procs
from services.cli.client import CoordinatorClient
from services.contracts import keys
from services.infra.settings import settings_env
from services.rollout.settings import RolloutSettings
from services.weights.transfer import WeightClient
from tests.harness.deploy import Deployment, DeploymentConfig
from tests.integration import conftest
from tests.integration.conftest import small_spec, wait_until

BLOCK = 1024 * 1024
RUN = "fanout-run"


start_store = functools.partial(conftest.start_store, block_bytes=BLOCK)


def publish(tmp_path, store, nbytes):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(os.urandom(nbytes))
    asyncio.run(WeightClient([store.url]).upload_folder(src, RUN, 0))
    return src


def puller(tmp_path, name, store, redis_url, serve=True, **settings):
    env = settings_env(
        RolloutSettings,
        worker_id=name,
        redis_url=redis_url,
        weightstore_url=store.url,
        **settings,
    )
    args = [sys.executable, "-m", "services.rollout.peer_pull", "--run", RUN, "--version", "0"]
    args += ["--dest", str(tmp_path / name / "v0")] + (["--serve"] if serve else [])
    return procs.start(name, args, env, tmp_path / "logs")


def outcome(proc) -> dict | None:
    """The JSON line a puller prints once its pull is done."""
    for line in proc.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            return json.loads(line)
    if not proc.alive():
        raise procs.died(proc)
    return None


def held(r, name) -> int:
    """Blocks a puller has announced as verified (all: -1)."""
    raw = r.hget(keys.weight_holders(RUN, 0), name)
    if raw is None:
        return 0
    blocks = json.loads(raw)["blocks"]
    return -1 if blocks == "all" else bin(int(blocks, 16)).count("1")


def same_files(a, b) -> bool:
    return all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in ("config.json", "model.safetensors")
    )


def test_a_peer_killed_mid_transfer_and_a_corrupt_peer(tmp_path, empty_redis_url):
    r = redis.Redis.from_url(empty_redis_url)
    store = start_store(tmp_path / "ws")
    running = [store]
    try:
        src = publish(tmp_path, store, 48 * BLOCK)
        # A seeds the version from the store, then serves it slowly (6 MB/s: a block in flight
        # for the better part of a second)
        a = puller(tmp_path, "a", store, empty_redis_url, peer_egress_mbps=48)
        running.append(a)
        first = wait_until(lambda: outcome(a), "seeder a's pull", 120)
        assert first["from_peers"] == 0
        # B takes every block from A while A holds them all; A dies in the middle
        b = puller(tmp_path, "b", store, empty_redis_url)
        running.append(b)
        wait_until(lambda: held(r, "b") >= 3, "b verifying blocks from a", 120)
        a.kill()
        got = wait_until(lambda: outcome(b), "b's pull after a died", 120)
        assert 0 < got["from_peers"] < got["bytes"]
        assert got["digest"] == first["digest"]
        assert same_files(src, tmp_path / "b" / "v0")
        assert not (tmp_path / "b" / "v0.partial").exists()
        log_b = b.log_path.read_text()
        assert re.search(r"not using peer http://\S+ for this version", log_b), log_b[-2000:]

        # B's copy rots on disk: C, pulling from B, drops B at the first bad block
        on_b = tmp_path / "b" / "v0" / "model.safetensors"
        with open(on_b, "r+b") as fh:
            for offset in range(0, 48 * BLOCK, BLOCK):
                fh.seek(offset + 100)
                fh.write(b"\xff\x00\xff")
        c = puller(tmp_path, "c", store, empty_redis_url, serve=False)
        running.append(c)
        got_c = wait_until(lambda: outcome(c), "c's pull", 120)
        assert got_c["digest"] == first["digest"]
        assert same_files(src, tmp_path / "c" / "v0")
        log_c = c.log_path.read_text()
        assert "sha256 mismatch" in log_c and "not using peer" in log_c, log_c[-2000:]
    finally:
        for proc in running:
            if proc.alive():
                proc.stop()


def test_with_p2p_off_every_block_comes_from_the_store(tmp_path, empty_redis_url):
    r = redis.Redis.from_url(empty_redis_url)
    store = start_store(tmp_path / "ws")
    running = [store]
    try:
        publish(tmp_path, store, 8 * BLOCK)
        a = puller(tmp_path, "a", store, empty_redis_url)
        running.append(a)
        wait_until(lambda: outcome(a), "a's pull", 120)
        b = puller(tmp_path, "b", store, empty_redis_url, serve=False, p2p="false")
        running.append(b)
        got = wait_until(lambda: outcome(b), "b's pull", 120)
        assert got["from_peers"] == 0 and got["bytes"] == 8 * BLOCK + 2
        assert r.hkeys(keys.weight_holders(RUN, 0)) == [b"a"]  # b offers nothing
    finally:
        for proc in running:
            if proc.alive():
                proc.stop()


def pulled_from_peers(worker) -> tuple[int, int]:
    """(bytes, of them from peers) of the worker's load of v0, from its log."""
    found = re.search(
        r"loaded \S+ v0 \((\d+) bytes, (\d+) of them from peers\)", worker.log_path.read_text()
    )
    return (int(found[1]), int(found[2])) if found else (0, 0)


def loaded(worker) -> list[str]:
    """The versions the worker's log says it loaded, as the log says it."""
    return re.findall(r"loaded \S+ v\d+ \([^)]*\)", worker.log_path.read_text())


def test_workers_joining_a_run_pull_their_weights_from_the_first(tiny_model, tmp_path):
    """1 store + 4 rollout workers in a real run: the second and later take most of v0's
    blocks from the workers that hold it; the store serves the first."""
    config = DeploymentConfig(
        tmp_path / "deploy",
        reserved=0,
        preemptible=0,
        extra_env={"SPOTRL_BLOCK_BYTES": str(64 * 1024)},
        # decode steps of 2 s and 64 tokens a response: step 0 lasts two minutes, far longer
        # than the later workers take to start on a loaded machine, so v0 stays current (with
        # the task's few tokens it ended first in a CI, and they loaded v1)
        worker_env={"SPOTRL_STEP_DELAY_MS": "2000"},
    )
    with Deployment(config) as dep:
        client = CoordinatorClient(dep.coordinator_url)
        rdb = redis.Redis.from_url(dep.redis_url)
        spec = small_spec(
            tiny_model,
            steps=2,
            prompts_per_step=2,
            group_size=2,
            max_new_tokens=64,
            ignore_eos=True,
        )
        run_id = client.submit(spec)
        wait_until(lambda: rdb.get(keys.run_version(run_id)) is not None, "v0 announced", 120)
        first = dep.add_worker("preemptible")
        wait_until(lambda: pulled_from_peers(first)[0], "the first worker's load of v0", 120)
        assert pulled_from_peers(first)[1] == 0  # nobody held it: all from the store
        later = [dep.add_worker("preemptible", wait=False) for _ in range(3)]
        loads = wait_until(
            lambda: (
                all(pulled_from_peers(w)[0] for w in later)
                and [pulled_from_peers(w) for w in later]
            ),
            lambda: (
                "the later workers' loads of v0; what they loaded: "
                + "; ".join(f"{w.name}: {loaded(w)}" for w in later)
            ),
            180,
        )
        for total, from_peers in loads:
            assert from_peers > total / 2, loads

        def offered_by(worker) -> list[int]:
            """The versions of the run whose holders list the worker."""
            versions = range(spec["steps"] + 1)
            return [v for v in versions if rdb.hexists(keys.weight_holders(run_id, v), worker.name)]

        wait_until(lambda: offered_by(first), "the first worker offers no version", 60)
        dep.procs.pop(first.name).stop()  # SIGTERM: the preemption notice
        assert offered_by(first) == []  # it left: it offers its blocks no more
        assert all(offered_by(w) for w in later)


def test_a_stale_block_port_is_asked_again_and_one_out_of_reach_is_left(tmp_path):
    """A client whose store's block server moved (the store restarted) asks where it is again;
    one that cannot reach it (a port Compose does not publish to the host) takes the blocks from
    the store's API after two failed attempts."""
    store = start_store(tmp_path / "ws")
    try:
        src = publish(tmp_path, store, 3 * BLOCK)
        unreachable = f"http://127.0.0.1:{procs.free_port()}"
        client = WeightClient([store.url])
        client._block_sources[store.url] = unreachable
        result = asyncio.run(client.pull(RUN, 0, tmp_path / "a", attempts=3))
        assert same_files(src, result.folder)
        assert client._block_sources[store.url] not in (unreachable, store.url)

        client = WeightClient([store.url])

        async def out_of_reach(base):
            return unreachable

        client._ask_block_source = out_of_reach  # type: ignore[method-assign]
        result = asyncio.run(client.pull(RUN, 0, tmp_path / "b", attempts=3))
        assert same_files(src, result.folder)
        assert client._block_misses[store.url] == 2
    finally:
        store.stop()


def test_a_store_without_its_block_server_serves_the_files_from_its_api(tmp_path):
    store = start_store(tmp_path / "ws", serve_blocks="false")
    try:
        src = publish(tmp_path, store, 2 * BLOCK)
        client = WeightClient([store.url])
        result = asyncio.run(client.pull(RUN, 0, tmp_path / "dst"))
        assert same_files(src, result.folder)
        assert client._block_sources[store.url] == store.url  # GET /v1/blocks: 404
    finally:
        store.stop()

"""Integration fixtures: real redis-server and real service processes, torn down by pid.

Tests wait on conditions (`wait_until`), never for a fixed time: a loaded machine only makes
them slower, not wrong."""

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from services.cli import procs
from services.cli.client import CoordinatorClient
from services.cli.redis_client import open_redis
from services.contracts import keys
from services.contracts.messages import Heartbeat
from services.contracts.runspec import FINAL_STATES
from services.coordinator.step.store import replay
from services.core.request_table import request_id
from tests.harness.deploy import Deployment, DeploymentConfig


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    """One reserved and one preemptible worker; a test module overrides this for its own (with
    `deploy_config`)."""
    return deploy_config(tmp_path_factory.mktemp("deploy"))


def deploy_config(folder: Path, **over) -> DeploymentConfig:
    """The tests' deployment in `folder`: one reserved and one preemptible worker of 16 slots
    that flush every 2 tokens, with `over` (any `DeploymentConfig` field) on top. Every test
    module's `deployment_config` is built here."""
    return DeploymentConfig(folder, **({"worker_slots": 16, "flush_tokens": 2} | over))


@pytest.fixture(scope="module")
def deployment(deployment_config):
    with Deployment(deployment_config) as dep:
        yield dep
    for proc in dep.procs.values():
        assert not proc.alive(), f"{proc.name} survived stop()"


@pytest.fixture(scope="module")
def client(deployment):
    c = CoordinatorClient(deployment.coordinator_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def rdb(deployment):
    r = redis.Redis.from_url(deployment.redis_url)
    yield r
    r.close()


def short_heartbeat_env(ttl_s: float = 1.5, grace_s: float = 5) -> dict[str, str]:
    """Workers that beat every 0.3 s and count as dead `ttl_s` after their last beat, whose
    engine steps last 40 ms at least (generation can be caught in the middle), and that leave
    within `grace_s` of a notice."""
    return {
        "SPOTRL_HEARTBEAT_S": "0.3",
        "SPOTRL_HEARTBEAT_TTL_S": str(ttl_s),
        "SPOTRL_STEP_DELAY_MS": "40",
        "SPOTRL_PREEMPT_GRACE_S": str(grace_s),
    }


def start_store(root: Path, port: int | None = None, name: str = "", **settings) -> procs.Proc:
    """A weight-store process on `root`'s data folder (the same folder on a restart), its log
    under `root`, on `port` (None: a free one), with `settings` as its SPOTRL_ variables
    (`keep_versions=30`: SPOTRL_KEEP_VERSIONS=30); healthy (stopped again if it never was)."""
    port = port or procs.free_port()
    env = {"SPOTRL_PORT": str(port), "SPOTRL_ROOT": str(root / "data")}
    env |= {f"SPOTRL_{k.upper()}": str(v) for k, v in settings.items()}
    proc = procs.start_service(name or f"ws-{port}", "services.weightstore.main", env, root, port)
    try:
        procs.wait_healthy([proc], 60)
    except BaseException:
        proc.stop()
        raise
    return proc


def short_heartbeat_config(
    folder: Path, preemptible: int, ttl_s: float = 1.5, grace_s: float = 5, **over
) -> DeploymentConfig:
    """`preemptible` preemptible workers of 4 slots, no reserved one, with a short heartbeat
    (short_heartbeat_env): for tests that kill, freeze or notify workers mid-generation."""
    env = short_heartbeat_env(ttl_s, grace_s)
    return deploy_config(
        folder,
        **({"reserved": 0, "preemptible": preemptible, "worker_slots": 4, "extra_env": env} | over),
    )


def small_spec(model, **over) -> dict:
    spec = {
        "model": str(model),
        "task": "arithmetic",
        "group_size": 3,
        "prompts_per_step": 4,
        "steps": 3,
        "max_new_tokens": 4,
        "temperature": 1.0,
        "learning_rate": 1e-4,
        "micro_batch_size": 8,
        "seed": 1,
    }
    return spec | over


def lora_specs(model, steps: int, seeds_and_rates) -> list[dict]:
    """Small LoRA runs (r 4) on one base, one per (seed, learning rate): runs one engine
    serves at once."""
    return [
        small_spec(
            model,
            steps=steps,
            seed=seed,
            lora_r=4,
            lora_alpha=8,
            learning_rate=lr,
            max_new_tokens=8,
        )
        for seed, lr in seeds_and_rates
    ]


def heartbeats_of(rdb: redis.Redis, workers) -> dict[str, Heartbeat]:
    """The live heartbeats of `workers` (those whose key has lapsed left out)."""
    raw = {w: rdb.get(keys.worker_heartbeat(w)) for w in workers}
    return {w: Heartbeat.decode(b) for w, b in raw.items() if b}


def wait_final(client, deployment, run_id, timeout_s=240.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        deployment.check_alive()
        run = client.run(run_id)
        if run["state"] in FINAL_STATES:
            return run
        time.sleep(0.3)
    logs = "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in deployment.procs.values())
    stacks = service_stacks(deployment, [n for n in deployment.procs if n != "redis"])
    clients = redis_clients(deployment.redis_url)
    raise TimeoutError(
        f"run {run_id} not finished after {timeout_s}s:\n{logs}\n{clients}\n{stacks}"
    )


def redis_clients(url: str) -> str:
    """Redis's clients now, with the command each runs or is blocked in, and its clock."""
    try:
        with open_redis(url, socket_timeout=5) as r:
            seconds, micros = r.time()
            listing = r.execute_command("CLIENT LIST")
    except redis.RedisError as exc:
        return f"--- redis clients: {exc}"
    text = listing.decode() if isinstance(listing, bytes) else str(listing)
    skew = seconds + micros / 1e6 - time.time()
    return f"--- redis clients (its clock - ours: {skew:+.3f}s)\n{text}"


def service_stacks(deployment, names, timeout_s: float = 10.0) -> str:
    """Where these services' threads and asyncio tasks wait now (SIGUSR1: `stack_dump`), as
    they write it to their logs."""
    procs = [p for p in deployment.procs.values() if p.name in names and p.alive()]
    sizes = {p.name: p.log_path.stat().st_size for p in procs}
    for p in procs:
        os.kill(p.pid, signal.SIGUSR1)
    out = []
    for p in procs:

        def dumped(p=p) -> str:
            with open(p.log_path, "rb") as f:
                f.seek(sizes[p.name])
                text = f.read().decode(errors="replace")
            return text if "asyncio tasks" in text else ""

        with contextlib.suppress(TimeoutError):
            out.append(f"--- {p.name} stacks\n" + wait_until(dumped, "no stacks", timeout_s, 0.1))
    return "\n".join(out)


def wait_until(
    condition, what: str | Callable[[], str], timeout_s: float = 60.0, poll_s: float = 0.02
):
    """Poll `condition()` until it returns something truthy, and return that; after `timeout_s`
    raise TimeoutError saying what never happened (`what` may be a callable, for details read
    at that moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            detail = what() if callable(what) else what
            raise TimeoutError(f"after {timeout_s:.0f}s: {detail}")
        time.sleep(poll_s)


def run_events(rdb, run_id: str, kind: str | None = None) -> list[dict]:
    """The run's timeline events (keys.run_events), oldest first, of one kind if given."""
    events = [json.loads(f[b"e"]) for _, f in rdb.xrange(keys.run_events(run_id))]
    return [e for e in events if kind is None or e["kind"] == kind]


def read_groups(deployment, run_id):
    """The groups the trainer took, quarantined ones included, by step then prompt: its
    rollout dump (Redis deletes a step's groups once its version is committed)."""
    from services.trainer.rollouts import read_rollouts

    return read_rollouts(deployment.rollouts_dir / run_id)


def collected(rdb, run_id: str, step: int) -> dict[str, int]:
    """Tokens the coordinator has stored for each request of `step` that has some (its durable
    request table, one coordinator shard: a delta entry is deleted once what it carried is
    stored)."""
    arrays = replay(rdb.lrange(keys.step_log(run_id, step), 0, -1))
    return {request_id(step, p, s): len(a.token_ids) for (p, s), a in arrays.items() if a.token_ids}


def holds_unfinished_jobs(rdb, run_id: str, worker: str, step: int = 0) -> bool:
    """`worker` holds jobs of `step` (read, not acknowledged) and the run has stored some of
    that step's tokens: it is mid-generation."""
    try:
        consumers = rdb.xinfo_consumers(keys.jobs_stream(run_id, step), keys.WORKERS_GROUP)
    except redis.ResponseError:
        return False
    held = any(c["name"].decode() == worker and c["pending"] > 0 for c in consumers)
    return held and sum(collected(rdb, run_id, step).values()) > 0


def finished_requests(rdb, run_id: str, step: int) -> set[tuple[str, int]]:
    """(request, lease) of every finished request of `step`, from the request table."""
    out = set()
    for rid, raw in rdb.hgetall(keys.step_requests(run_id, step)).items():
        lease, finish = raw.decode().split("|")[:2]
        if finish:
            out.add((rid.decode(), int(lease)))
    return out


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A private redis-server on a free port."""
    work = tmp_path_factory.mktemp("redis")
    proc, url = procs.start_redis(work, work / "data")
    yield url
    proc.stop()


@pytest.fixture
def empty_redis_url(redis_url):
    """The session's private redis-server, database 1, emptied for this test: tests that
    drive the coordinator's Redis modules directly (no service process) start from nothing."""
    url = redis_url.rsplit("/", 1)[0] + "/1"
    with redis.Redis.from_url(url) as r:
        r.flushdb()
    return url

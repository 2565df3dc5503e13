"""Integration fixtures: real redis-server and real service processes, torn down by pid."""

import time

import pytest
import redis

from services.cli.client import CoordinatorClient
from services.cli.deploy import Deployment, DeploymentConfig
from services.common import keys
from services.common.runspec import FINAL_STATES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    """One reserved and one preemptible worker; a test module overrides this for its own."""
    return DeploymentConfig(
        tmp_path_factory.mktemp("deploy"),
        reserved=1,
        preemptible=1,
        worker_slots=16,
        flush_tokens=2,
    )


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


def wait_final(client, deployment, run_id, timeout_s=240.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        deployment.check_alive()
        run = client.run(run_id)
        if run["state"] in FINAL_STATES:
            return run
        time.sleep(0.3)
    logs = "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in deployment.procs.values())
    raise TimeoutError(f"run {run_id} not finished after {timeout_s}s:\n{logs}")


def read_groups(rdb, run_id):
    from services.common.messages import Group

    return [Group.from_fields(f) for _, f in rdb.xrange(keys.groups_stream(run_id))]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A private redis-server on a free port."""
    from services.cli import procs

    work = tmp_path_factory.mktemp("redis")
    proc, url = procs.start_redis(work, work / "data")
    yield url
    proc.stop()

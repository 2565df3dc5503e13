"""The Swarm stack rendered from docker-compose.yml and docker-compose.swarm.yml
(tools/swarm_stack.py): every service of the compose file, placed by pool, on its node's
network, with nothing Swarm would refuse or a registry would be asked for. Fast: no engine."""

from pathlib import Path

import pytest
import yaml

from tests.compose.engine import EngineUnavailable, compose_binary
from tests.swarm.stack import REGISTRY_LOOKUP
from tools.swarm_stack import RenderError, compose_config, render, stack_from_config

ENV = {
    "PATH": "/usr/bin:/bin",
    "SPOTRL_API_TOKEN": "t0ken",
    "SPOTRL_RESERVED_HOST": "10.254.0.10",
    "SPOTRL_MODELS": "/srv/models",
}
HOSTS = {"reserved": "10.254.0.10", "spot1": "10.254.0.11", "spot2": "10.254.0.12"}


@pytest.fixture(scope="module")
def stack() -> dict:
    try:
        compose_binary()
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    return yaml.safe_load(render(ENV, HOSTS))


def test_every_compose_service_is_in_the_stack_placed_by_pool(stack):
    compose = yaml.safe_load(Path("docker-compose.yml").read_text())
    assert set(stack["services"]) == set(compose["services"])
    for name, svc in stack["services"].items():
        pool = "spot" if name == "rollout" else "reserved"
        assert svc["deploy"]["placement"]["constraints"] == [f"node.labels.pool == {pool}"]
        assert svc["networks"] == ["hostnet"]
        assert not {"build", "ports", "restart", "depends_on", "pull_policy"} & set(svc), name
        assert "spot2:10.254.0.12" in svc["extra_hosts"]
    assert stack["networks"]["hostnet"] == {"external": True, "name": "host"}


def test_the_services_reach_redis_and_each_other_at_the_reserved_node_with_the_token(stack):
    for name, svc in stack["services"].items():
        if name == "redis":
            assert "--requirepass" in svc["command"] and "t0ken" in svc["command"]
            continue
        env = svc["environment"]
        assert env["SPOTRL_REDIS_URL"] == "redis://:t0ken@10.254.0.10:6379/0"
        assert env["SPOTRL_COORDINATOR_URL"] == "http://10.254.0.10:8100"
        assert env["SPOTRL_API_TOKEN"] == "t0ken"


def test_a_worker_advertises_its_node_and_its_grace_covers_the_release(stack):
    rollout = stack["services"]["rollout"]
    env = rollout["environment"]
    assert env["SPOTRL_PEER_HOST"] == "{{.Node.Hostname}}"
    grace_s = int(rollout["stop_grace_period"].rstrip("s"))
    assert grace_s > float(env["SPOTRL_PREEMPT_GRACE_S"])
    assert rollout["deploy"]["replicas"] == 2


def test_the_render_refuses_what_swarm_cannot_run():
    try:
        config = compose_config(ENV)
    except RenderError as exc:
        pytest.skip(str(exc))
    config["services"]["coordinator"]["ports"] = [{"target": 8100, "published": "8100"}]
    with pytest.raises(RenderError, match="published ports"):
        stack_from_config(config, HOSTS)
    del config["services"]["coordinator"]["ports"]
    config["services"]["trainer"]["network_mode"] = "bridge"
    with pytest.raises(RenderError, match="network_mode must be host"):
        stack_from_config(config, HOSTS)
    config["services"]["trainer"]["network_mode"] = "host"
    config["services"]["trainer"]["privileged"] = True
    with pytest.raises(RenderError, match="no rule for"):
        stack_from_config(config, HOSTS)


def test_no_token_no_stack():
    with pytest.raises(RenderError, match="SPOTRL_API_TOKEN"):
        compose_config({k: v for k, v in ENV.items() if k != "SPOTRL_API_TOKEN"})


def test_the_registry_check_sees_a_lookup_and_nothing_else():
    looked_up = [
        'level=info msg="Attempting next endpoint for pull after error: manifest unknown"',
        'level=error msg="pulling image failed" image="spotrl:latest"',
        'msg="Get \\"https://registry-1.docker.io/v2/\\": dial tcp: lookup registry-1.docker.io'
        ' on 10.254.0.1:53: no route to host"',
    ]
    quiet = [
        'level=info msg="[core] ccResolverWrapper: sending update to cc" module=grpc',
        'level=info msg="Node 8b3c/10.254.0.11, joined gossip cluster"',
    ]
    assert all(REGISTRY_LOOKUP.search(line) for line in looked_up)
    assert not any(REGISTRY_LOOKUP.search(line) for line in quiet)

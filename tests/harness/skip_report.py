"""The skip report of a test session: which groups of tests this machine cannot run, said at
the session's start (from the same tool checks the tests make) and again just before
pytest's closing line (from the tests that did skip), each group with the command that
installs what it lacks.

This module decides nothing about skipping: each test still skips by its own check (or, with
CI=true, fails). It only names groups and reports; tests/conftest.py calls it from pytest's
hooks. A group's tools are checked only where the session selected one of its tests.
"""

import importlib.util
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """A set of tests that need the same tools; `install` is the command that installs them."""

    title: str
    install: str


DOCKER = "make setup-docker (apt-get as root: docker.io, debootstrap, iproute2, util-linux)"
GROUPS: dict[str, Group] = {
    "compose": Group("Docker Compose test (tests/compose)", DOCKER),
    "swarm": Group("Docker Swarm tests (tests/swarm, the scaler's Swarm target)", DOCKER),
    "browser": Group(
        "dashboard browser test",
        "make setup-browser (apt-get as root: chromium, chromium-driver)",
    ),
    "chart": Group("Helm chart tests (tests/chart)", "make setup-chart"),
    "vllm": Group("vLLM engine tests", "make setup-vllm"),
    "gpu": Group("CUDA tests", "none: they need a machine with a CUDA GPU"),
    "other": Group("other tests", "see each reason in the short test summary above"),
}
ORDER = list(GROUPS)


def group_of_item(markers: Iterable[str], fixtures: Iterable[str], module: str) -> str | None:
    """The group of a collected test, from its markers, its fixtures and its module's file name
    (None: a test that needs nothing this machine may lack)."""
    markers, fixtures = set(markers), set(fixtures)
    if "compose" in markers:
        return "compose"
    if "swarm" in markers or "swarm" in fixtures:
        return "swarm"
    if "browser" in fixtures:
        return "browser"
    if "chart" in markers:
        return "chart"
    if "vllm" in module:
        return "vllm"
    if "gpu" in markers:
        return "gpu"
    return None


def group_of_skip(collected: str | None, reason: str) -> str:
    """The group a skipped test is reported under: its collection group, else by its reason."""
    if collected is not None:
        return collected
    low = reason.lower()
    if "vllm" in low:
        return "vllm"
    if "cuda" in low:
        return "gpu"
    return "other"


def skipped_by_group(reports: Iterable, groups: dict[str, str | None]) -> dict[str, list[str]]:
    """Group -> reasons of pytest's skip `reports`, a test's group taken from `groups` (node id
    -> its collection group)."""
    out: dict[str, list[str]] = {}
    for report in reports:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        out.setdefault(group_of_skip(groups.get(report.nodeid), reason), []).append(reason)
    return out


def _compose_missing() -> list[str]:
    from tests.compose.engine import EngineUnavailable, compose_binary, missing_tools

    try:
        compose_binary()
    except EngineUnavailable as exc:
        return [str(exc)]
    return missing_tools()


def _swarm_missing() -> list[str]:
    from tests.swarm.cluster import missing_tools

    return missing_tools()


def _browser_missing() -> list[str]:
    from tests.harness.browser import CHROMIUM, DRIVER

    out = [] if importlib.util.find_spec("selenium") else ["selenium"]
    for names, env in ((CHROMIUM, "SPOTRL_CHROMIUM"), (DRIVER, "SPOTRL_CHROMEDRIVER")):
        if not os.environ.get(env) and not any(shutil.which(n) for n in names):
            out.append(names[0])
    return out


def _chart_missing() -> list[str]:
    from tests.chart.helm import ToolMissing, helm_binary

    out = []
    try:
        helm_binary()
    except ToolMissing:
        out.append("helm")
    for module in ("kubernetes_validate", "cloudcoil.models.keda"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            out.append(module)
    return out


def _vllm_missing() -> list[str]:
    return [] if importlib.util.find_spec("vllm") else ["vllm"]


CHECKS = {
    "compose": _compose_missing,
    "swarm": _swarm_missing,
    "browser": _browser_missing,
    "chart": _chart_missing,
    "vllm": _vllm_missing,
}


def missing_by_group(counts: dict[str, int]) -> dict[str, list[str]]:
    """For each selected group (`counts`: tests selected per group) whose tools are not all
    here, what is missing. The CUDA group is left to the end report."""
    out = {}
    for name in ORDER:
        if counts.get(name) and name in CHECKS:
            missing = CHECKS[name]()
            if missing:
                out[name] = missing
    return out


def start_lines(missing: dict[str, list[str]], counts: dict[str, int], ci: bool) -> list[str]:
    """The session's opening report: each group that will not run here and how to install it."""
    if not missing:
        return []
    verb = "FAIL (CI=true)" if ci else "be SKIPPED"
    lines = [f"these tests will {verb} on this machine; install what they need first:"]
    for name in ORDER:
        if name in missing:
            group = GROUPS[name]
            lines.append(
                f"  {group.title}, {counts[name]} selected: missing {', '.join(missing[name])}"
                f"\n      -> {group.install}"
            )
    return lines


def end_lines(skipped: dict[str, list[str]]) -> list[str]:
    """The session's closing report from what skipped (`skipped`: group -> reasons)."""
    if not skipped:
        return ["no test was skipped"]
    total = sum(len(r) for r in skipped.values())
    lines = [f"{total} tests SKIPPED, by group (each group runs once its command has run):"]
    for name in ORDER:
        reasons = skipped.get(name)
        if not reasons:
            continue
        group = GROUPS[name]
        first = sorted(set(reasons))[0]
        lines.append(f"  {group.title}: {len(reasons)} skipped: {first}")
        lines.append(f"      -> {group.install}")
    return lines

"""PromQL evaluated for real without a server: `promtool test rules` (Debian's prometheus
package; tools/install-chart-tools.sh installs it) evaluates a query over input series and
compares the result with what is expected. Used to read the autoscaler's query at the values
that matter; nothing here talks to a Prometheus."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.chart.helm import SETUP_HINT

PROMTOOL_TIMEOUT_S = 30
Series = dict[str, float]  # a gauge's name -> its value (labels: the coordinator's)


def require_promtool() -> str:
    """promtool's path; skip with the reason where it is missing (CI=true: fail)."""
    found = shutil.which("promtool")
    if found:
        return found
    reason = f"promtool missing ({SETUP_HINT}: apt-get install prometheus)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must test the chart: {reason}")
    pytest.skip(reason)


def expectation_problem(query: str, series: Series, want: float | None, labels: str) -> str:
    """Why `query` over these gauges (each one sample, `labels` on every series) is not `want`
    (None: no sample at all); empty when it is."""
    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": f"{gauge}{{{labels}}}", "values": str(value)}
                    for gauge, value in series.items()
                ],
                "promql_expr_test": [
                    {
                        "expr": query,
                        "eval_time": "0m",
                        "exp_samples": [] if want is None else [{"labels": "{}", "value": want}],
                    }
                ],
            }
        ],
    }
    with tempfile.TemporaryDirectory(prefix="spotrl-promql-") as folder:
        path = Path(folder) / "test.yml"
        path.write_text(yaml.safe_dump(test))
        done = subprocess.run(
            [require_promtool(), "test", "rules", str(path)],
            capture_output=True,
            text=True,
            timeout=PROMTOOL_TIMEOUT_S,
        )
    if done.returncode == 0:
        return ""
    said = " ".join((done.stdout + done.stderr).split())
    got = said.partition("got:")[2].strip() or said
    return f"with {series or 'no gauge'}: want {'no sample' if want is None else want}, got {got}"


WANTED = "spotrl_coordinator_preemptible_wanted"
ACTIVE = "spotrl_coordinator_runs_active"
COORDINATOR_LABELS = 'namespace="rl", container="coordinator", pod="spotrl-coordinator-0"'


def query_problems(query: str, hold_all: float) -> list[str]:
    """The autoscaler's reading of the gauges: no run active -> 0 (the pool's minimum), a run
    active without a figure -> hold_all (maxReplicas x K), a figure -> the figure, a stale
    figure with no run active -> 0, no gauge at all -> no sample (KEDA's fallback)."""
    cases: list[tuple[Series, float | None]] = [
        ({ACTIVE: 0, WANTED: 0}, 0),
        ({ACTIVE: 1, WANTED: 0}, hold_all),
        ({ACTIVE: 1, WANTED: 5}, 5),
        ({ACTIVE: 2, WANTED: 7}, 7),
        ({ACTIVE: 0, WANTED: 5}, 0),
        ({}, None),
    ]
    return [
        f"query {query!r}: {problem}"
        for series, want in cases
        if (problem := expectation_problem(query, series, want, COORDINATOR_LABELS))
    ]


def scaled_object_problems(objs: list[dict]) -> list[str]:
    """Each ScaledObject's query, read at the values that matter (query_problems); hold_all is
    its maxReplicaCount times K (its threshold: K pools share the figure)."""
    out = []
    for o in objs:
        if o["kind"] != "ScaledObject":
            continue
        for trigger in o["spec"]["triggers"]:
            meta = trigger["metadata"]
            hold_all = o["spec"]["maxReplicaCount"] * int(meta["threshold"])
            out += query_problems(meta["query"], hold_all)
    return out

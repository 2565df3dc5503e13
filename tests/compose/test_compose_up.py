"""`docker compose up`, for real: the stack built offline and run by Compose on an engine of the
test's own (tests/compose/scenario.py). Where no engine can start here it skips with the reason;
with CI=true it fails instead (.ci/run installs docker.io, debootstrap and compose v2)."""

import json
import os
from pathlib import Path

import pytest

from tests.compose.engine import EngineUnavailable, compose_binary, missing_tools
from tests.compose.scenario import STEPS, run_scenario

pytestmark = [pytest.mark.compose, pytest.mark.timeout(2700)]
SUMMARY = Path(os.environ.get("SPOTRL_COMPOSE_SUMMARY", ".spotrl/test-compose.json"))


def require_engine() -> None:
    try:
        compose_binary()
        missing = missing_tools()
        if missing:
            raise EngineUnavailable("missing: " + ", ".join(missing))
    except EngineUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Compose test: {exc}")
        pytest.skip(f"no Docker engine can start here: {exc} (make test-compose says how)")


def test_compose_up_runs_scales_survives_kills_and_leaves_nothing(tmp_path):
    require_engine()
    summary = run_scenario(tmp_path)
    SUMMARY.parent.mkdir(parents=True, exist_ok=True)
    SUMMARY.write_text(json.dumps(summary) + "\n")
    assert summary["state"] == "succeeded", summary
    assert summary["steps"] == STEPS, summary
    assert summary["reward_last"] > summary["reward_first"], summary
    assert summary["workers_max"] >= 2, summary
    assert summary["killed"] == 1 and summary["lost"] == 0 and summary["duplicated"] == 0, summary
    assert summary["trainer_resumed"], summary
    assert summary["init_model_in_container"], summary  # `spotrl init-model` in the container
    assert summary["leftovers"] == [] and summary["private_addresses"] == [], summary
    assert summary["worker_secrets"] == [], summary  # least privilege: a worker holds its own

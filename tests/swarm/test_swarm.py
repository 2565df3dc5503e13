"""A real multi-host run on Docker Swarm (tests/swarm/scenario.py): three nodes in network
namespaces, the stack from docker-compose.yml, a spot node cut off from the network and back,
a spot node drained and a rollout container killed mid-run; exact, learning, and nothing left
behind. Where no engine can start here it
skips with the reason; with CI=true it fails instead (.ci/run installs docker.io)."""

import json
import os
from pathlib import Path

import pytest

from tests.compose.engine import EngineUnavailable
from tests.swarm.scenario import STEPS, run_scenario
from tests.swarm.test_cluster import require_engine

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(1500)]
SUMMARY = Path(os.environ.get("SPOTRL_SWARM_SUMMARY", ".spotrl/test-swarm.json"))


def test_swarm_run_survives_a_drain_and_a_kill_exact_and_leaves_nothing(tmp_path):
    require_engine()
    try:
        summary = run_scenario(tmp_path)
    except EngineUnavailable as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"no swarm can start here: {exc}")
    SUMMARY.parent.mkdir(parents=True, exist_ok=True)
    SUMMARY.write_text(json.dumps(summary) + "\n")
    print(json.dumps(summary))
    assert summary["nodes"] == 3, summary
    assert summary["state"] == "succeeded" and summary["steps"] == STEPS, summary
    assert summary["reward_last"] > summary["reward_first"], summary
    assert summary["workers_max"] >= 2, summary
    assert summary["blocks_from_peers"] > 0, summary
    assert summary["drained"] == 1 and summary["killed"] == 1, summary
    assert summary["partitioned"] == 1 and summary["fenced_late_deltas"] >= 1, summary
    # each loss's requests generated again elsewhere, the notice's too (a number: the watch
    # follows the drained worker from the drain); how fast is a figure, not checked here (a
    # loaded machine queues the continuations behind the step's fresh jobs for seconds)
    assert summary["recovery_partition_s"] is not None, summary
    assert summary["recovery_notice_s"] is not None, summary
    assert summary["lost"] == 0 and summary["duplicated"] == 0, summary
    # the container killed held requests still generating, and each generated again elsewhere
    assert summary["recovery"]["kill"]["held"] > 0, summary
    assert summary["recovery_kill_s"] is not None and summary["recovery_kill_s"] > 0, summary
    assert summary["scale_decisions"] >= 1, summary
    assert summary["registry_lookups"] == [] and summary["stack_left"] == [], summary
    assert summary["leftovers"] == [], summary

"""The swarm harness alone (tests/swarm/cluster.py): three dockerds in network namespaces form
one swarm with its node labels, the test's client namespace reaches the manager and nothing
outside the subnet, and teardown leaves nothing behind. Quick (no image, no stack)."""

import os
import socket

import pytest

from tests.compose.engine import EngineUnavailable
from tests.swarm.cluster import missing_tools, running_cluster

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(300)]


def require_engine() -> None:
    missing = missing_tools()
    if not missing:
        return
    reason = "missing: " + ", ".join(missing)
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the swarm tests: {reason}")
    pytest.skip(f"no swarm can start here: {reason} (make test-swarm says how)")


def test_three_nodes_form_a_labelled_swarm_and_leave_nothing():
    require_engine()
    try:
        with running_cluster() as cluster:
            assert sorted(cluster.ready_nodes()) == ["reserved", "spot1", "spot2"]
            assert cluster.labels() == {"reserved": "reserved", "spot1": "spot", "spot2": "spot"}
            for member in [*cluster.nodes, "client"]:
                routes = cluster.fabric.routes(member)  # docker_gwbridge too, inside a node
                assert routes[0].startswith("10.254.0.0/24 dev eth0"), routes
                assert not [r for r in routes if r.startswith("default")], routes
            with cluster.client_netns():
                with socket.create_connection((cluster.manager.addr, 2377), timeout=5):
                    pass
                with pytest.raises(OSError):  # no route out of the subnet
                    socket.create_connection(("10.253.0.1", 9), timeout=2)
            for node in cluster.nodes.values():
                assert node.processes(), f"{node.name}: no process of its own"
    except EngineUnavailable as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"no swarm can start here: {exc}")
    assert cluster.leftovers() == []

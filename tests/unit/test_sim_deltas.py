"""Sparse deltas and cross-region pools in the simulator's weight model (issue 42): a delta pull
moves `delta_share` of the bytes, a boot pulls a whole version, the remote region's pulls share
one link, and without deltas or a remote region the pulls are timed as before."""

from dataclasses import replace

import pytest

from services.infra.traces import TracePoint
from services.sim.engine import SimEngine
from services.sim.fleet import FLEET_SYSTEM_CHOICES as CHOICES
from services.sim.fleet import CrossRegion, FleetShape, run_fleet
from services.sim.instances import REMOTE_SUFFIX
from services.sim.profile import QWEN3_14B
from services.sim.scenario import TransferModel
from services.sim.simulation import Simulation
from services.sim.state import Instance
from services.sim.systems import HYBRID
from tests.unit.test_simulator import small_scenario

STORE = TransferModel(weight_bytes=QWEN3_14B.weight_bytes)  # 29.6 GB, 200 / 100 Gbit/s
P2P = replace(STORE, p2p=True)
LINK = STORE.cross_region_bytes_per_s  # 2 Gbit/s


def test_without_deltas_or_a_remote_region_the_pulls_are_timed_as_before():
    """Pinned from the model before issue 42 (store only, P2P, slow peers, 4 shards)."""
    slow_peers = replace(P2P, peer_upload_bytes_per_s=0.5e9)
    pins = {
        STORE: [4.368, 5.552, 77.776, 305.104],
        P2P: [4.368, 4.37824, 4.39872, 4.40896],
        slow_peers: [4.368, 5.552, 36.00308771929824, 52.55079738562092],
        replace(STORE, replicas=4): [6.736, 16.208, 305.104, 1214.416],
    }
    for model, seconds in pins.items():
        assert [model.pull_s(n) for n in (1, 3, 64, 256)] == seconds
        # holding the version before changes nothing while deltas are off
        assert [model.pull_s(n, holds_previous=True) for n in (1, 3, 64, 256)] == seconds


@pytest.mark.parametrize("share", [0.05, 0.2])
def test_a_delta_pull_moves_the_share_of_the_bytes_store_and_link_bound(share):
    for model in (STORE, P2P):
        deltas = replace(model, delta_share=share)
        for route, n in (("store", 1), ("store", 64), ("store", 256), ("link", 1), ("link", 8)):
            full = deltas.pull_s(n, holds_previous=False, route=route) - STORE.load_s
            delta = deltas.pull_s(n, holds_previous=True, route=route) - STORE.load_s
            assert full + STORE.load_s == model.pull_s(n, route=route)  # a whole one as before
            fill = 0.0 if not model.p2p else 8 * model.block_bytes / STORE.nic_bytes_per_s
            assert share * full - 1e-9 <= delta <= share * full + fill + 1e-9
    store_bound = replace(STORE, delta_share=0.05).pull_s(256, holds_previous=True)
    assert store_bound == pytest.approx(0.05 * 29.6e9 * 256 / 25e9 + 2.0)  # 15.2 s, not 303
    link_bound = replace(STORE, delta_share=0.05).pull_s(1, holds_previous=True, route="link")
    assert link_bound == pytest.approx(0.05 * 29.6e9 / LINK + 2.0)  # 5.9 s, not 118


def test_the_remote_pulls_share_the_link_and_p2p_carries_a_version_once():
    for k in (1, 2, 8):  # store only: the k-th remote pull gets a k-th of the link
        assert STORE.pull_s(k, route="link") == STORE.weight_bytes / (LINK / k) + STORE.load_s
    assert STORE.pull_s(8, route="store") < 20 < 900 < STORE.pull_s(8, route="link")
    # P2P: the region's swarm is fed by the link, W / link whatever the pullers
    assert P2P.pull_s(1, route="link") == pytest.approx(29.6e9 / LINK + 2.0)
    assert P2P.pull_s(16, route="link") - P2P.pull_s(1, route="link") < 0.05
    # a region that holds the version already serves it at a peer's NIC
    assert P2P.pull_s(1, route="peers") == P2P.pull_s(1, route="store")
    # the bytes over the link: every pull without P2P; with it, the first, for every shard
    assert [STORE.link_bytes(29.6e9, first) for first in (True, False)] == [29.6e9, 29.6e9]
    shards = replace(P2P, replicas=4, delta_share=0.05)
    delta = shards.pull_bytes(holds_previous=True)
    assert shards.link_bytes(delta, first=True) == pytest.approx(0.05 * 29.6e9 / 4)
    assert shards.link_bytes(29.6e9, first=True) == 29.6e9 / 4
    assert shards.link_bytes(29.6e9, first=False) == 0.0


def test_the_remote_share_spreads_over_the_starts():
    assert not any(STORE.starts_remote(i) for i in range(100))  # default: one region
    half = replace(STORE, remote_share=0.5)
    assert [half.starts_remote(i) for i in range(6)] == [False, True] * 3
    quarter = replace(STORE, remote_share=0.25)
    assert sum(quarter.starts_remote(i) for i in range(64)) == 16
    assert all(replace(STORE, remote_share=1.0).starts_remote(i) for i in range(10))


def sim_with(transfer: TransferModel) -> Simulation:
    sim = Simulation(replace(small_scenario(), transfer=transfer), HYBRID, [])
    sim.clock.version = 5
    return sim


def add(sim: Simulation, name: str, state: str, version: int | None) -> Instance:
    inst = Instance(name, "preemptible", SimEngine(sim.sc.spot_engine), 5.32, 0.0)
    inst.state, inst.version = state, version  # type: ignore[assignment]
    sim.fleet.instances[name] = inst
    return inst


def test_a_boot_pulls_whole_and_an_instance_one_version_behind_pulls_the_delta():
    sim = sim_with(replace(STORE, delta_share=0.05))
    boot = add(sim, "spot-0", "pulling", None)
    assert sim.fleet.pull_s(boot) == STORE.pull_s(1)  # held nothing: the whole version
    behind = add(sim, "spot-1", "pulling", 4)
    assert sim.fleet.pull_s(behind) == pytest.approx(0.05 * STORE.pull_s(2) + 0.95 * STORE.load_s)
    stale = add(sim, "spot-2", "pulling", 3)  # missed a version: the whole one
    assert sim.fleet.pull_s(stale) == STORE.pull_s(3)
    assert sim.totals.pulls == 3 and sim.totals.max_pull_s == STORE.pull_s(3)


def test_in_the_simulation_the_remote_region_shares_the_link_apart_from_the_home_pulls():
    sim = sim_with(replace(STORE, remote_share=0.5))
    add(sim, "spot-0", "pulling", 4)  # a home pull under way: not on the link
    first = add(sim, f"spot-1{REMOTE_SUFFIX}", "pulling", 4)
    assert sim.fleet.pull_s(first) == STORE.pull_s(1, route="link")
    second = add(sim, f"spot-3{REMOTE_SUFFIX}", "pulling", 4)
    assert sim.fleet.pull_s(second) == STORE.pull_s(2, route="link")
    assert sim.fleet.cross_region_bytes == 2 * STORE.weight_bytes
    p2p = sim_with(replace(P2P, remote_share=0.5))
    add(p2p, f"spot-1{REMOTE_SUFFIX}", "up", 5)  # the region holds the latest version
    joiner = add(p2p, f"spot-3{REMOTE_SUFFIX}", "pulling", None)
    assert p2p.fleet.pull_s(joiner) == P2P.pull_s(1, route="peers") < 5
    assert p2p.fleet.cross_region_bytes == 0.0


def test_the_fleet_runs_a_cross_region_pool_with_and_without_deltas():
    """One shard of 16, half remote, a fast link: the deltas shorten the pulls and bill less
    egress; the boots still pull whole versions, so the longest pull is the same."""
    names = ("hybrid-p2p", "hybrid-p2p-xr", "hybrid-p2p-xr-delta")
    systems = tuple(CHOICES[n] for n in names)
    link = CrossRegion(link_bytes_per_s=2.5e9)  # 20 Gbit/s: a whole version in 12 s, a step 50
    trace = [TracePoint(0, 16)]
    fleet = run_fleet(small_scenario(), trace, FleetShape.of(16), 1, 0, 0, systems, 5, link)
    home, full, delta = (fleet["systems"][n] for n in names)
    assert home["cross_region_gb"] == 0 and home["egress_usd_per_h"] == 0
    assert 29.6 <= delta["cross_region_gb"] < full["cross_region_gb"]
    assert full["egress_usd_per_h"] > delta["egress_usd_per_h"] > 0
    assert delta["mean_pull_s"] < full["mean_pull_s"]
    assert delta["max_pull_s"] == full["max_pull_s"] > 13  # the boots: 11.8 s over the link + load
    for s in (full, delta):
        assert s["tokens_per_dollar"] == pytest.approx(
            s["throughput_tok_s"] * 3600 / s["cost_per_h"]
        )
    assert CrossRegion().transfer_changes(CHOICES["hybrid-p2p"]) == {}


def test_cli_refuses_bad_cross_region_settings(capsys):
    from bench.sim_fleet import parse_args

    args = parse_args(["--trace", "t.csv", "--delta-share", "0.03", "--cross-region-gbps", "4"])
    assert args.cross_region == CrossRegion(0.5, 0.5e9, 0.02, 0.03)
    for bad in (["--remote-share", "1.5"], ["--delta-share", "0"], ["--cross-region-gbps", "0"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(["--trace", "t.csv", *bad])
        assert exc.value.code == 2

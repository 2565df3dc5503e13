"""The simulator at fleet scale (services/sim/fleet.py): the peer-to-peer pull model against the
store-only one, a trace's counts scaled to a fleet, the fleet's shards, and a small fleet run."""

import math
from dataclasses import replace

import pytest

from services.infra.traces import TracePoint, load_trace
from services.sim.fleet import FLEET_SYSTEMS, FleetShape, fleet_scenario, fleet_targets, run_fleet
from services.sim.profile import QWEN3_14B
from services.sim.scenario import TransferModel, paper_14b
from services.sim.simulation import Simulation
from services.sim.systems import HYBRID
from tests.unit.test_simulator import DATA, small_scenario

STORE = TransferModel(weight_bytes=QWEN3_14B.weight_bytes)  # 29.6 GB, 200 / 100 Gbit/s
P2P = replace(STORE, p2p=True)
SIZES = [1, 2, 3, 4, 8, 16, 64, 100, 256, 1024]


def test_store_only_pulls_are_as_before():
    w, e, nic = STORE.weight_bytes, STORE.store_egress_bytes_per_s, STORE.nic_bytes_per_s
    for n in SIZES:
        assert STORE.pull_s(n) == w / min(nic, e / max(1, n)) + STORE.load_s
    assert STORE.pull_s(0) == STORE.pull_s(1)
    assert STORE.pull_s(64) == pytest.approx(77.8, abs=0.1)  # the issue's ~76 s, plus the load
    assert STORE.pull_s(256) == pytest.approx(305.1, abs=0.1)


def test_one_puller_takes_the_same_time_with_p2p():
    assert P2P.pull_s(1) == STORE.pull_s(1)
    slow_nic = replace(P2P, nic_bytes_per_s=40e9, peer_upload_bytes_per_s=1e9)  # store-bound
    assert slow_nic.pull_s(1) == replace(slow_nic, p2p=False).pull_s(1)


@pytest.mark.parametrize("upload", [None, 12.5e9, 3e9, 0.5e9])
def test_p2p_is_never_slower_and_stops_growing_with_the_pullers(upload):
    p2p = replace(P2P, peer_upload_bytes_per_s=upload)
    times = [p2p.pull_s(n) for n in SIZES]
    assert all(t <= STORE.pull_s(n) + 1e-9 for t, n in zip(times, SIZES, strict=True))
    assert times == sorted(times)  # more pullers never pull faster
    u = STORE.nic_bytes_per_s if upload is None else upload
    relays = math.ceil(math.log2(SIZES[-1])) * p2p.block_bytes / min(u, STORE.nic_bytes_per_s)
    # bounded by the peers' upload (W / U) whatever the fleet: the store is no longer the limit
    ceiling = max(STORE.weight_bytes / u, STORE.weight_bytes / STORE.nic_bytes_per_s)
    assert times[-1] <= ceiling + relays + STORE.load_s
    if upload is None or upload >= STORE.nic_bytes_per_s:  # the NIC: flat but for the relays
        assert times[-1] - times[1] <= relays
    assert STORE.pull_s(256) > 10 * p2p.pull_s(256) or u < 1e9


def test_replicas_count_the_pulls_of_every_shard():
    for model in (STORE, P2P):
        for k in (1, 3, 16):
            assert replace(model, replicas=16).pull_s(k) == model.pull_s(16 * k)


def test_a_trace_is_scaled_to_the_fleet():
    trace = [TracePoint(0, 10), TracePoint(100, 10), TracePoint(100, 5), TracePoint(300, 7)]
    for n in (16, 64, 256):
        assert fleet_targets(trace, n, hours=1) == [
            (0.0, n),
            (100.0, round(5 * n / 10)),
            (300.0, round(7 * n / 10)),
        ]
    real = load_trace(DATA / "aws-g4dn-xlarge-us-east-1c-2020-11-20.csv")  # peak 12
    small, large = fleet_targets(real, 16, hours=24), fleet_targets(real, 256, hours=24)
    assert max(c for _, c in small) == 16 and max(c for _, c in large) == 256
    assert [t for t, _ in small] == [t for t, _ in large]  # the same changes, 16 x the counts
    assert all(abs(c * 16 - big) <= 8 for (_, c), (_, big) in zip(small, large, strict=True))


def test_fleet_shapes():
    assert FleetShape.of(256) == FleetShape(256, nodes=32, replicas=16)
    shape = FleetShape.of(64, nodes=8)
    assert (shape.replicas, shape.shard_instances, shape.shard_nodes) == (4, 16, 2)
    assert FleetShape.of(16).replicas == 1  # 2 nodes: one shard, the whole fleet
    assert FleetShape.of(64, shard_nodes=8).replicas == 1
    for bad in ({"instances": 64, "nodes": 3}, {"instances": 20}, {"instances": 4}):
        with pytest.raises(ValueError):
            FleetShape.of(**bad)
    with pytest.raises(ValueError):
        FleetShape.of(30, nodes=4, shard_nodes=1)
    sc = fleet_scenario(paper_14b(), FleetShape.of(256), p2p=True)
    assert sc.workload.prompts_per_step == 256 and sc.reserved_scaling == 1.0
    assert sc.transfer.p2p and sc.transfer.replicas == 16


def test_one_shard_is_the_simulator_itself():
    """A fleet of one shard runs the plain simulation (its figures are not scaled)."""
    shape = FleetShape.of(16)
    targets = [(0.0, 16)]
    fleet = run_fleet(small_scenario(), [TracePoint(0, 16)], shape, hours=1, max_steps=3)
    sc = fleet_scenario(small_scenario(), shape, p2p=False)
    sim = Simulation(sc, replace(HYBRID, reserved_nodes=2), targets, 0, 3600, 3).run()
    got = fleet["systems"]["hybrid"]
    assert got["tokens_trained"] == sim.totals.trained
    assert got["mean_step_s"] == sim.records[-1].end_s / 3


def test_a_small_fleet_trains_every_step_and_p2p_pays_at_scale():
    """256 instances in 16 shards, short steps: the store-only pulls (~5 min) dominate."""
    trace = [TracePoint(0, 12), TracePoint(400, 9), TracePoint(700, 12)]
    fleet = run_fleet(small_scenario(), trace, FleetShape.of(256), hours=1, max_steps=4)
    assert fleet["requests_per_step"] == 16 * 4 * 32
    runs = fleet["systems"]
    assert list(runs) == [fs.name for fs in FLEET_SYSTEMS]
    for s in runs.values():
        assert s["steps"] == 4 and s["stall_s"] == 0
        assert s["tokens_generated"] == s["tokens_trained"] + s["tokens_lost"]
        assert s["mean_trainer_s"] <= s["mean_step_s"]
    assert runs["reserved-only"]["throughput_vs_first"] == 1.0
    assert runs["reserved-only"]["mean_pull_s"] is None
    store, p2p = runs["hybrid"], runs["hybrid-p2p"]
    assert p2p["max_pull_s"] < 10 < 250 < store["max_pull_s"]
    assert p2p["mean_step_s"] < store["mean_step_s"]
    assert p2p["throughput_tok_s"] > store["throughput_tok_s"]
    assert p2p["preemptions"] % 16 == 0  # the shards lose instances together


def test_cli_refuses_a_missing_trace_and_a_fleet_that_does_not_split(tmp_path, capsys):
    from bench.sim_fleet import main

    assert main(["--trace", str(tmp_path / "missing.csv")]) == 2
    trace = str(DATA / "aws-g4dn-xlarge-us-east-1c-2020-11-20.csv")
    for bad in (["--fleet", "20"], ["--systems", "hybrid,nope"], ["--nodes", "3"]):
        with pytest.raises(SystemExit) as exc:
            main(["--trace", trace, *bad])
        assert exc.value.code == 2

"""LoRA versions in the simulator's weight model (issue 51): an instance pulls the base once, at
its boot, then each version's adapter only, whatever it missed; a new instance pulls the base
again; the remote region takes the base from its peers; the engines decode at the factor given;
and the fleet comparison runs the LoRA systems beside full weights and deltas."""

from dataclasses import replace

import pytest

from services.infra.traces import TracePoint
from services.sim.fleet import FLEET_SYSTEM_CHOICES as CHOICES
from services.sim.fleet import FleetShape, FleetSystem, LoraAdapters, run_fleet
from services.sim.instances import REMOTE_SUFFIX
from services.sim.profile import QWEN3_14B
from services.sim.scenario import TransferModel
from services.sim.systems import HYBRID
from tests.unit.test_sim_deltas import add, sim_with
from tests.unit.test_simulator import small_scenario

W = QWEN3_14B.weight_bytes  # 29.6 GB
SHARE = 0.0187  # r 8 on qwen2-236m, fp32 (bench/lora.py)
ADAPTER = SHARE * W
LORA = TransferModel(weight_bytes=W, adapter_share=SHARE)
LORA_P2P = replace(LORA, p2p=True)


def test_a_boot_moves_the_base_and_the_adapter_and_any_holder_the_adapter_only():
    assert LORA.pull_parts(False, holds_base=False) == (("base", W), ("adapter", ADAPTER))
    for holds_previous in (True, False):  # an adapter is whole by itself: no chain to replay
        assert LORA.pull_parts(holds_previous, holds_base=True) == (("adapter", ADAPTER),)
    assert LORA.pull_bytes(False) == pytest.approx(1.0187 * W)
    for route in ("store", "link", "peers"):
        for n in (1, 8, 64):
            base, adapter = LORA.move_s(n, W, route), LORA.move_s(n, ADAPTER, route)
            assert LORA.pull_s(n, route=route) == pytest.approx(base + adapter + LORA.load_s)
            assert LORA.pull_s(n, True, route, holds_base=True) == adapter + LORA.load_s
    assert LORA.pull_s(64, holds_base=True) == pytest.approx(ADAPTER * 64 / 25e9 + 2.0)  # 3.4 s
    with pytest.raises(ValueError):
        replace(LORA, delta_share=0.05)
    with pytest.raises(ValueError):
        FleetSystem("both", HYBRID, deltas=True, lora=True)


def test_an_instance_pulls_the_base_once_then_adapters_and_a_new_one_the_base_again():
    sim = sim_with(LORA)
    fleet, totals = sim.fleet, sim.totals
    fleet.on_target(1)  # the cloud offers one instance: it boots
    (first,) = fleet.pool_instances()
    fleet.on_booted(first.name)  # holds nothing: the base, then version 5's adapter
    assert totals.pulled_bytes == pytest.approx(W + ADAPTER)
    assert totals.max_pull_s == pytest.approx(LORA.pull_s(1))
    fleet.on_pulled((first.name, 5))
    assert first.state == "up" and first.version == 5
    for version in (6, 7, 10):  # one behind each time, then 2 versions missed: the adapter
        sim.clock.version = version
        before = totals.pulled_bytes
        fleet.pull(first)
        assert totals.pulled_bytes - before == pytest.approx(ADAPTER)
        fleet.on_pulled((first.name, version))
    assert totals.pulls == 4 and totals.pulled_bytes == pytest.approx(W + 4 * ADAPTER)
    assert totals.max_pull_s == pytest.approx(LORA.pull_s(1))  # the boot's
    fleet.on_target(0)  # taken back
    fleet.on_target(1)  # a new instance (a reboot holds nothing): the base again
    (second,) = fleet.pool_instances()
    assert second.name != first.name and second.version is None
    before = totals.pulled_bytes
    fleet.on_booted(second.name)
    assert totals.pulled_bytes - before == pytest.approx(W + ADAPTER)


def test_the_remote_region_carries_the_base_once_and_takes_it_from_its_peers():
    sim = sim_with(replace(LORA_P2P, remote_share=0.5))
    fleet = sim.fleet
    boot = add(sim, f"spot-1{REMOTE_SUFFIX}", "pulling", None)  # the region holds nothing
    assert fleet.pull_s(boot) == pytest.approx(LORA_P2P.pull_s(1, route="link"))
    assert fleet.cross_region_bytes == pytest.approx(W + ADAPTER)  # each crosses once
    second = add(sim, f"spot-3{REMOTE_SUFFIX}", "pulling", None)
    fleet.pull_s(second)  # the same version, while the first pulls: from the swarm
    assert fleet.cross_region_bytes == pytest.approx(W + ADAPTER)
    boot.state, boot.version, second.state = "up", 5, "gone"
    joiner = add(sim, f"spot-5{REMOTE_SUFFIX}", "pulling", None)  # the region serves version 5
    assert fleet.pull_s(joiner) == pytest.approx(LORA_P2P.pull_s(1, route="peers"))
    joiner.state = "gone"
    sim.clock.version = 6  # a new adapter: the base from a peer, the adapter over the link
    late = add(sim, f"spot-7{REMOTE_SUFFIX}", "pulling", None)
    seconds = LORA_P2P.move_s(1, W, "peers") + LORA_P2P.move_s(1, ADAPTER, "link") + 2.0
    assert fleet.pull_s(late) == pytest.approx(seconds)
    assert fleet.cross_region_bytes == pytest.approx(W + 2 * ADAPTER)
    late.state, boot.state = "gone", "pulling"  # the first pulls version 6: its adapter only
    assert fleet.pull_s(boot) == pytest.approx(LORA_P2P.pull_s(1, True, "link", True))
    assert fleet.cross_region_bytes == pytest.approx(W + 2 * ADAPTER)  # version 6's crossed


def test_the_engines_decode_at_the_factor_and_the_lora_scenario_sets_both():
    sc = small_scenario()
    assert sc.spot_engine.decoding_at(1.0) is sc.spot_engine
    slow = sc.spot_engine.decoding_at(0.8)
    for batch, context in ((1, 256), (64, 3000), (256, 16384)):
        assert slow.step_s(batch, context) == pytest.approx(
            sc.spot_engine.step_s(batch, context) / 0.8
        )
    assert slow.prefill_s(1000) == sc.spot_engine.prefill_s(1000)
    assert slow.kv_capacity_tokens == sc.spot_engine.kv_capacity_tokens
    lora = LoraAdapters(SHARE, decode_factor=0.8).apply(sc)
    assert lora.transfer.adapter_share == SHARE and lora.spot_engine == slow
    assert lora.reserved_engine == sc.reserved_engine.decoding_at(0.8)
    with pytest.raises(ValueError):
        sc.spot_engine.decoding_at(0.0)


@pytest.mark.slow  # ~2 s: in make test, not make test-fast
def test_the_fleet_runs_lora_beside_full_weights_and_deltas():
    """One shard of 16, 5 steps: LoRA pulls the base at each boot and then an adapter, fewer
    bytes than deltas (which pull a whole version at each boot too), far fewer than full; a
    slower decode lowers the throughput and nothing else changes its bytes."""
    names = ("hybrid", "hybrid-delta", "hybrid-lora", "hybrid-p2p-lora")
    systems = tuple(CHOICES[n] for n in names)
    trace = [TracePoint(0, 16)]
    fleet = run_fleet(small_scenario(), trace, FleetShape.of(16), 1, 0, 0, systems, 5)
    full, delta, lora, p2p = (fleet["systems"][n] for n in names)
    assert list(fleet["systems"]) == list(names)
    assert lora["pulled_gb"] < delta["pulled_gb"] < full["pulled_gb"]
    assert lora["mean_pull_s"] < delta["mean_pull_s"] < full["mean_pull_s"]
    assert p2p["max_pull_s"] < lora["max_pull_s"]
    for s in (full, delta, lora, p2p):
        assert s["steps"] == 5 and s["stall_s"] == 0
        assert s["tokens_generated"] == s["tokens_trained"] + s["tokens_lost"]
    slow = run_fleet(
        small_scenario(), trace, FleetShape.of(16), 1, 0, 0, systems[2:3], 5, None,
        LoraAdapters(decode_factor=0.5),
    )["systems"]["hybrid-lora"]  # fmt: skip
    assert slow["throughput_tok_s"] < lora["throughput_tok_s"]


def test_cli_takes_the_lora_settings_and_refuses_bad_ones():
    from bench.sim_fleet import parse_args

    args = parse_args(["--trace", "t.csv", "--systems", "hybrid-lora,hybrid-p2p-lora"])
    assert args.lora == LoraAdapters() and [fs.lora for fs in args.systems] == [True, True]
    args = parse_args(
        ["--trace", "t.csv", "--adapter-share", "0.01", "--lora-decode-factor", "0.9"]
    )
    assert args.lora == LoraAdapters(0.01, 0.9)
    for bad in (
        ["--adapter-share", "0"],
        ["--adapter-share", "1.5"],
        ["--lora-decode-factor", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            parse_args(["--trace", "t.csv", *bad])
        assert exc.value.code == 2

"""The trained ledger's compact records and the Redis memory brake: pure parts."""

import msgspec

from services.contracts.messages import Group, Response
from services.coordinator.step.memory import pressure
from services.state.ledger import StepLedger, bitmap_members
from services.state.redis_figures import MIB, MemoryReading


def group(p: int, tokens: list[list[int]], quarantined: bool = False) -> Group:
    return Group(
        run_id="r",
        step=0,
        prompt_index=p,
        prompt_ids=[1],
        responses=[
            Response(token_ids=t, logprobs=[0.0] * len(t), reward=0.0, finish_reason="length")
            for t in tokens
        ],
        quarantined=quarantined,
    )


def test_a_ledger_record_is_small_and_says_what_was_trained():
    led = StepLedger()
    for p in range(256):
        led.add(group(p, [[1] * 256] * 8))
    led.quarantined.add(300)
    led.duplicates = 1
    rec = led.record()
    assert bitmap_members(rec["trained"]) == set(range(256))
    assert bitmap_members(rec["quarantined"]) == {300}
    assert rec["responses"] == 256 * 8 and rec["tokens"] == 256 * 8 * 256
    assert rec["duplicates"] == 1 and rec["incomplete"] == 0
    assert len(str(rec)) < 400  # whatever the step's size
    assert led.seen(3) and led.seen(300) and not led.seen(299)


def test_the_ledger_hash_depends_on_every_token_and_not_on_arrival_order():
    a, b, c = StepLedger(), StepLedger(), StepLedger()
    a.add(group(0, [[1, 2], [3]]))
    b.add(group(0, [[1, 2], [3]]))
    c.add(group(0, [[1], [2, 3]]))  # the same tokens cut differently
    assert a.record()["sha256"] == b.record()["sha256"] != c.record()["sha256"]


def test_bitmaps_round_trip_empty_and_sparse_sets():
    for members in (set(), {0}, {5, 64, 1000}):
        led = StepLedger(trained=set(members))
        assert bitmap_members(led.record()["trained"]) == members


def test_pressure_brakes_over_the_high_mark_only_with_a_limit():
    assert pressure(MemoryReading(900 * MIB, 0), 0.85) is None  # no limit known: no brake
    assert pressure(MemoryReading(800 * MIB, 1000 * MIB), 0.85) is None
    reason = pressure(MemoryReading(850 * MIB, 1000 * MIB), 0.85)
    assert reason is not None
    assert "850 MiB" in reason and "85%" in reason and "1000 MiB" in reason
    assert "maxmemory" in reason  # says what to do


def test_the_ledger_keeps_the_oldest_version_that_generated_a_trained_token():
    led = StepLedger()
    led.add(group(0, [[1, 2]]))  # no runs recorded: says nothing
    assert led.record()["oldest_version"] is None
    g = group(1, [[1, 2, 3]])
    runs = [(0, 4), (2, 5)]
    led.add(
        msgspec.structs.replace(
            g, responses=[msgspec.structs.replace(g.responses[0], version_runs=runs)]
        )
    )
    assert led.record()["oldest_version"] == 4

"""The rollout worker's DeltaBuffer: when a flush is due, what it carries, what a failed flush
leaves pending, offsets, and which job entries are acknowledged."""

from dataclasses import dataclass

import msgspec

from services.contracts.messages import RequestLease
from services.rollout.delta_buffer import DeltaBuffer
from tests.factories import job as make_job


@dataclass
class Tok:
    request_id: str
    token_id: int
    logprob: float = -0.5
    finish_reason: str | None = None
    drafted: int = 0
    accepted: int = 0


def buffer(flush_steps=4, flush_ms=100, now_s=0.0) -> DeltaBuffer:
    return DeltaBuffer("w1", flush_steps, flush_ms, now_s)


def started(*rids, prefix=(), lease=0) -> DeltaBuffer:
    buf = buffer()
    for rid in rids:
        buf.start(make_job(rid, [1, 2], 8, prefix=prefix, lease=lease), f"e-{rid}".encode())
    return buf


def test_a_flush_is_due_after_flush_steps_decode_steps():
    buf = started("a")
    for _ in range(3):
        buf.record_step([Tok("a", 5)])
        assert not buf.flush_due(0.01)
    buf.record_step([Tok("a", 5)])
    assert buf.flush_due(0.01)


def test_a_flush_is_due_flush_ms_after_the_last_one():
    buf = started("a")
    buf.record_step([Tok("a", 5)])
    assert not buf.flush_due(0.099)
    assert buf.flush_due(0.100)
    buf.take(0.100, version=0)
    assert not buf.flush_due(0.150)
    assert buf.flush_due(0.200)


def test_a_flush_is_due_as_soon_as_a_request_finishes():
    buf = started("a", "b")
    assert buf.record_step([Tok("a", 5), Tok("b", 6, finish_reason="stop")]) == 1
    assert buf.flush_due(0.0)
    buf.take(0.0, version=0)
    assert not buf.flush_due(0.0)


def test_a_flush_carries_new_tokens_from_the_offset_after_the_prefix():
    buf = started("a", "b", prefix=[7, 7, 7], lease=2)
    buf.record_step([Tok("a", 5, -0.1), Tok("b", 6, -0.2)])
    buf.record_step([Tok("a", 8, -0.3)])
    flush = buf.take(0.0, version=3)
    assert flush is not None
    batch = flush.batch
    assert (batch.worker_id, batch.version, batch.released) == ("w1", 3, [])
    a, b = batch.items
    assert (a.request_id, a.lease, a.offset, a.token_ids, a.logprobs) == (
        "a",
        2,
        3,
        [5, 8],
        [-0.1, -0.3],
    )
    assert (b.offset, b.token_ids, b.finished) == (3, [6], False)
    assert flush.done == [] and flush.entry_ids == []


def test_offsets_advance_once_a_flush_is_sent():
    buf = started("a")
    buf.record_step([Tok("a", 5)])
    buf.sent(buf.take(0.0, version=0))
    buf.record_step([Tok("a", 6)])
    item = buf.take(0.0, version=0).batch.items[0]
    assert (item.offset, item.token_ids) == (1, [6])


def test_nothing_to_say_is_no_flush():
    buf = started("a")
    assert buf.take(0.0, version=0) is None
    buf.record_step([Tok("a", 5)])
    buf.sent(buf.take(0.0, version=0))
    assert buf.take(0.0, version=0) is None


def test_a_failed_flush_leaves_its_tokens_pending_for_the_next():
    buf = started("a")
    buf.record_step([Tok("a", 5)])
    failed = buf.take(0.0, version=0)  # never sent
    buf.record_step([Tok("a", 6, finish_reason="length")])
    again = buf.take(0.1, version=0)
    item = again.batch.items[0]
    assert (item.offset, item.token_ids, item.finished) == (0, [5, 6], True)
    assert failed.batch.items[0].token_ids == [5]
    buf.sent(again)
    assert buf.pending == {} and buf.take(0.2, version=0) is None


def test_tokens_recorded_while_a_flush_is_in_flight_stay_pending():
    buf = started("a")
    buf.record_step([Tok("a", 5)])
    flush = buf.take(0.0, version=0)
    buf.record_step([Tok("a", 6)])
    buf.sent(flush)
    item = buf.take(0.0, version=0).batch.items[0]
    assert (item.offset, item.token_ids) == (1, [6])


def test_a_flush_sent_twice_drops_its_tokens_once():
    buf = started("a")
    buf.record_step([Tok("a", 5)])
    first = buf.take(0.0, version=0)
    second = buf.take(0.0, version=0)  # a concurrent flush (the crash path) took them too
    buf.record_step([Tok("a", 6)])
    buf.sent(first)
    buf.sent(second)
    item = buf.take(0.0, version=0).batch.items[0]
    assert (item.offset, item.token_ids) == (1, [6])


def test_a_finished_request_is_forgotten_and_its_entry_acked_once_sent():
    buf = started("a", "b")
    buf.record_step([Tok("a", 5, finish_reason="stop"), Tok("b", 6)])
    flush = buf.take(0.0, version=0)
    assert flush.done == ["a"] and flush.entry_ids == [b"e-a"]
    assert [r.request_id for r in buf.running()] == ["b"]
    assert "a" in buf.pending  # not before it is sent
    buf.sent(flush)
    assert list(buf.pending) == ["b"] and list(buf.entry_of) == ["b"]


def test_released_requests_follow_the_deltas_and_their_entries_are_acked():
    buf = started("a")
    buf.hold("q", b"e-q")  # read, never started
    buf.record_step([Tok("a", 5)])
    leases = [RequestLease(request_id="q", lease=0), RequestLease(request_id="a", lease=0)]
    flush = buf.take(0.0, version=1, released=leases, reason="balance")
    assert [i.token_ids for i in flush.batch.items] == [[5]]
    assert flush.batch.released == leases and flush.batch.release_reason == "balance"
    assert flush.done == ["q", "a"] and flush.entry_ids == [b"e-q", b"e-a"]
    buf.sent(flush)
    assert buf.pending == {} and buf.entry_of == {}


def test_a_release_with_no_tokens_is_still_a_flush():
    buf = buffer()
    flush = buf.take(0.0, version=0, released=[RequestLease(request_id="x", lease=1)])
    assert flush is not None and flush.batch.items == [] and flush.entry_ids == []


def test_forget_drops_only_the_lease_held_and_acks_nothing():
    buf = started("a", lease=1)
    assert not buf.forget(RequestLease(request_id="a", lease=0))
    assert buf.forget(RequestLease(request_id="a", lease=1))
    assert buf.pending == {} and buf.entry_of == {}
    assert not buf.forget(RequestLease(request_id="a", lease=1))


def test_tokens_of_requests_not_held_are_dropped():
    buf = started("a")
    assert buf.record_step([Tok("gone", 5, finish_reason="stop")]) == 0
    assert buf.take(0.0, version=0) is None


def test_an_isolated_request_is_seen_running_until_it_finishes():
    buf = buffer()
    buf.start(msgspec.structs.replace(make_job("s", [1], 4), isolate=True), b"e-s")
    assert buf.isolated_running
    buf.record_step([Tok("s", 5, finish_reason="length")])
    assert not buf.isolated_running


def test_running_lists_requests_in_the_order_they_started():
    buf = started("c", "a", "b", lease=3)
    buf.record_step([Tok("a", 5, finish_reason="stop")])
    assert buf.running() == [  # with their jobs' grants: a release proves the lease
        RequestLease(request_id="c", lease=3, grant="g"),
        RequestLease(request_id="b", lease=3, grant="g"),
    ]


def test_clear_forgets_everything():
    buf = started("a", "b")
    buf.record_step([Tok("a", 5)])
    buf.clear()
    assert buf.pending == {} and buf.entry_of == {} and buf.take(0.0, version=0) is None


def test_speculation_counts_travel_with_their_tokens_and_stay_pending_until_sent():
    buf = started("a")
    buf.record_step([Tok("a", 5, drafted=4, accepted=2), Tok("a", 6), Tok("a", 7)])
    first = buf.take(1.0, version=0)
    item = first.batch.items[0]
    assert (item.draft_forwards, item.drafted, item.accepted) == (1, 4, 2)
    buf.record_step([Tok("a", 8, drafted=4, accepted=0)])  # before the first flush is sent
    retry = buf.take(2.0, version=0)  # the first flush failed: its counts are carried again
    item = retry.batch.items[0]
    assert (item.draft_forwards, item.drafted, item.accepted) == (2, 8, 2)
    buf.sent(retry)
    buf.record_step([Tok("a", 9)])
    item = buf.take(3.0, version=0).batch.items[0]
    assert (item.token_ids, item.draft_forwards, item.drafted, item.accepted) == ([9], 0, 0, 0)


def test_requests_of_two_versions_flush_in_a_batch_each_the_releases_in_the_newest():
    """A LoRA engine runs a request under the adapter it started with: its tokens go in a
    batch of that version, older first; the releases travel in the flush version's batch."""
    buf = buffer()
    buf.start(make_job("2:0:0", [1], 8), b"e-old", version=1)
    buf.start(make_job("2:1:0", [1], 8), b"e-new", version=2)
    buf.start(make_job("2:2:0", [1], 8), b"e-idle", version=2)
    buf.record_step([Tok("2:0:0", 5), Tok("2:1:0", 6, finish_reason="stop")])
    assert buf.versions() == {1, 2}
    release = RequestLease(request_id="2:2:0", lease=0, grant="g")
    flush = buf.take(0.0, version=2, released=[release])
    assert [b.version for b in flush.batches] == [1, 2]
    assert [i.request_id for i in flush.batches[0].items] == ["2:0:0"]
    assert [i.request_id for i in flush.batch.items] == ["2:1:0"]
    assert flush.batch.released == [release] and not flush.batches[0].released
    buf.sent(flush)
    assert buf.pending["2:0:0"].tokens == [] and buf.pending["2:0:0"].offset == 1
    assert "2:1:0" not in buf.pending and buf.versions() == {1}
    # only the old version has tokens now: one batch, of it
    buf.record_step([Tok("2:0:0", 7)])
    assert [b.version for b in buf.take(0.0, version=2).batches] == [1]

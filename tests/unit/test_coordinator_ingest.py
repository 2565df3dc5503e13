"""The coordinator's ingest path made fast (issue 22) still keeps its rules: a read's deltas applied
in one pass (`RequestTable.apply_all`) do exactly what applying them one at a time under the
table's rules does; a read is split by step from its request ids' heads; the staged appends of a
read go to the script as one blob, each key's piece the new tokens only; the garbage collector is
off while a read is taken and back on after; a flush's time is read from its stream entry id."""

import gc
import random
from array import array

import pytest

from services.contracts.messages import DeltaBatch, DeltaItem, RequestLease
from services.coordinator.step.deltas import gc_paused
from services.coordinator.step.store import Arrays, RecordWriter, StepStore, replay
from services.core.collect import CollectRules, split_by_step
from services.core.request_table import Applied, RequestTable
from services.infra.redis_streams import StagedWrites, entry_time_s
from tests import factories
from tests.conftest import apply, apply_all, apply_held


def new_table(prompts: int = 3, n: int = 2, max_new: int = 6) -> RequestTable:
    return factories.table(prompts, n, max_new)


def item(rid, offset, tokens, lease=0, finished=False, reason=None) -> DeltaItem:
    return DeltaItem(
        request_id=rid,
        lease=lease,
        grant="",
        offset=offset,
        token_ids=tokens,
        logprobs=[-t / 10 for t in tokens],
        finished=finished,
        finish_reason=reason,
    )


class Spec:
    """The table's rules for one request, written plainly: the reference `apply_all` must match."""

    def __init__(self, max_new: int) -> None:
        self.max_new, self.lease, self.tokens, self.done = max_new, 0, [], False

    def take(self, d: DeltaItem) -> Applied:
        if d.lease != self.lease:
            return Applied.STALE_LEASE
        if self.done:
            return Applied.ALREADY_DONE
        if d.offset > len(self.tokens):
            return Applied.GAP
        room = self.max_new - len(self.tokens)
        new = d.token_ids[len(self.tokens) - d.offset :][:room]
        self.tokens += new
        if d.finished or len(new) >= room:
            self.done = True
            return Applied.FINISHED
        return Applied.APPENDED if new else Applied.DUPLICATE


def random_deltas(rng: random.Random, rids: list[str], spec: dict[str, Spec]) -> list[DeltaItem]:
    """Deltas as workers send them, and worse: repeats, overlaps, gaps, old leases, unknowns."""
    out = []
    for _ in range(rng.randrange(1, 12)):
        rid = rng.choice([*rids, "0:9:9"])
        have = len(spec[rid].tokens) if rid in spec else 0
        offset = max(0, have + rng.choice((-2, -1, 0, 0, 0, 1)))
        tokens = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 4))]
        lease = spec[rid].lease if rid in spec and rng.random() > 0.1 else rng.randrange(3)
        out.append(item(rid, offset, tokens, lease, finished=rng.random() < 0.05, reason="stop"))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_a_read_applied_in_one_pass_does_what_the_rules_say_one_delta_at_a_time(seed):
    rng = random.Random(seed)
    table = new_table()
    rids = list(table.requests)
    spec = {rid: Spec(6) for rid in rids}
    expected_stats = dict.fromkeys(table.stats, 0)
    for _ in range(15):
        if rng.random() < 0.2:  # a migration: the lease moves on, the tokens stay
            rid = rng.choice(rids)
            if table.migrate(rid, "balance") is not None:
                spec[rid].lease += 1
        deltas = random_deltas(rng, rids, spec)
        want = [
            spec[d.request_id].take(d) if d.request_id in spec else Applied.UNKNOWN for d in deltas
        ]
        for outcome in want:
            expected_stats[outcome.value] += 1
        assert apply_all(table, deltas, version=0) == want
    for rid in rids:
        r = table.requests[rid]
        assert r.token_ids == spec[rid].tokens
        assert r.logprobs == [-t / 10 for t in spec[rid].tokens]
        assert r.done == spec[rid].done
    assert table.stats == expected_stats
    assert table.tokens_appended == sum(len(s.tokens) for s in spec.values())
    assert table.unfinished_count == sum(not s.done for s in spec.values())


def test_version_runs_and_counts_follow_each_delta_of_a_batch():
    table = new_table(max_new=8)
    deltas = [item("0:0:0", 0, [1, 2]), item("0:0:0", 2, [3]), item("0:0:0", 1, [2, 3, 4])]
    assert apply_all(table, deltas, version=5) == [Applied.APPENDED] * 3
    apply_all(table, [item("0:0:0", 4, [5, 6])], version=6)
    assert table.requests["0:0:0"].version_runs == [(0, 5), (4, 6)]
    assert table.requests["0:0:0"].token_ids == [1, 2, 3, 4, 5, 6]
    assert table.tokens_received == 2 + 1 + 3 + 2
    assert apply(table, item("0:0:0", 6, [7, 8, 9])) is Applied.FINISHED  # cut at the budget
    assert table.requests["0:0:0"].token_ids[-2:] == [7, 8]
    assert table.requests["0:0:0"].finish_reason == "length"


def test_a_reads_outcome_counts_every_delta_once_out_of_bound_ones_included():
    table = factories.table([[1]] * 2, 2, 4, step=5)
    batches = [
        DeltaBatch(
            worker_id="w1",
            version=5,
            items=[
                item("5:0:0", 0, [1, 2]),
                item("5:0:0", 0, [1, 2]),  # again: nothing new
                item("5:0:1", 0, [1], lease=4),  # a lease it never had
                item("5:1:0", 0, [1, 2, 3], finished=True, reason="stop"),
                item("5:1:1", 3, [1]),  # a gap
            ],
        ),
        DeltaBatch(worker_id="w2", version=2, items=[item("5:0:1", 0, [7])]),  # too old
    ]
    out = apply_held(table, batches, CollectRules(max_staleness=1))
    assert out.applied == {
        "appended": 1,
        "duplicate": 1,
        "stale_lease": 1,
        "finished": 1,
        "gap": 1,
        "out_of_bound": 1,
    }
    assert out.changed == {"5:0:0", "5:1:0", "5:0:1"}  # 5:0:1 moved on to a new lease
    assert out.finished == ["5:1:0"]
    assert out.stale == {"w1": {("5:0:1", 4)}, "w2": {("5:0:1", 0)}}
    assert out.tokens_appended == 5


def test_a_read_is_split_by_the_step_its_request_ids_name():
    one = DeltaBatch(worker_id="w", version=3, items=[item("3:0:0", 0, [1]), item("3:1:0", 0, [2])])
    mixed = DeltaBatch(
        worker_id="w",
        version=3,
        items=[item("4:0:0", 0, [1]), item("3:0:1", 0, [2]), item("03:1:1", 0, [3])],
        released=[RequestLease(request_id="4:2:0", lease=1)],
    )
    odd = DeltaBatch(worker_id="w", version=3, items=[item("x:0:0", 0, [1])])
    empty = DeltaBatch(worker_id="w", version=3, items=[])
    parts = split_by_step([one, mixed, odd, empty])
    assert sorted(parts) == [-1, 3, 4]
    assert parts[3][0] is one  # a batch of one step goes whole
    assert [i.request_id for i in parts[3][1].items] == ["3:0:1", "03:1:1"]
    assert [i.request_id for i in parts[4][0].items] == ["4:0:0"]
    assert [r.request_id for r in parts[4][0].released] == ["4:2:0"]
    assert parts[3][1].released == []
    assert parts[-1] == [odd, empty]


def logged(staged: StagedWrites) -> dict[tuple[int, int], Arrays]:
    """The arrays the staged log record holds, by (prompt, sample), replayed on nothing."""
    (args,) = [a for name, a, _ in staged.ops if name == "rpush"]
    _, record = args
    return replay([record])


def test_a_read_appends_one_record_with_each_requests_new_tokens_only():
    table, store = new_table(max_new=8), StepStore(None, "run", 0)  # type: ignore[arg-type]
    apply_all(table, [item("0:0:0", 0, [1, 2]), item("0:1:0", 0, [3])], version=0)
    staged = StagedWrites()
    store.stage_requests(staged, table, {"0:0:0", "0:1:0"})
    assert [name for name, _, _ in staged.ops] == ["hset", "expire", "rpush", "expire"]
    record = logged(staged)
    assert record[(0, 0)] == Arrays([1, 2], [-0.1, -0.2], [(0, 0)])
    assert record[(1, 0)] == Arrays([3], [-0.3], [(0, 0)])

    apply_all(table, [item("0:0:0", 1, [2, 4], finished=True, reason="stop")], version=1)
    staged = StagedWrites()
    store.stage_requests(staged, table, {"0:0:0", "0:1:0"})  # 0:1:0 unchanged
    assert [name for name, _, _ in staged.ops] == ["hset", "rpush"]  # TTLs set already
    (rpush,) = [a for name, a, _ in staged.ops if name == "rpush"]
    assert len(rpush[1]) == 4 + 24 + 4 + 8 + 8  # one head; a token, its logprob, one run
    # the record alone: the new token from offset 2, a newer version's run from run 1
    heads = array("I", rpush[1][4:28]).tolist()
    assert heads == [0, 0, 2, 1, 1, 1]
    (hset,) = [kw for name, _, kw in staged.ops if name == "hset"]
    grant = table.requests["0:0:0"].grant
    # the finish; 0:1:0's state did not change
    assert hset["mapping"] == {"0:0:0": f"0|stop||{grant}"}

    staged = StagedWrites()
    store.stage_requests(staged, table, {"0:0:0"})
    assert staged.ops == []  # nothing changed: nothing written


def test_a_restart_from_zero_is_a_record_that_cuts_the_request_back():
    table, store = new_table(max_new=8), StepStore(None, "run", 0)  # type: ignore[arg-type]
    apply_all(table, [item("0:0:0", 0, [1, 2, 3])])
    first = StagedWrites()
    store.stage_requests(first, table, {"0:0:0"})
    table.migrate("0:0:0", "death", keep_tokens=False)
    apply_all(table, [item("0:0:0", 0, [9], lease=1)])
    staged = StagedWrites()
    store.stage_requests(staged, table, {"0:0:0"})
    records = [a[1] for ops in (first, staged) for name, a, _ in ops.ops if name == "rpush"]
    assert replay(records)[(0, 0)].token_ids == [9]
    assert replay(records)[(0, 0)].logprobs == [-0.9]


def test_the_log_replays_any_sequence_of_reads_into_the_tables_arrays():
    """Random reads (repeats, gaps refused, migrations with and without tokens kept): the
    records replayed give every request's arrays as the table holds them."""
    rng = random.Random(7)
    table, store = new_table(prompts=4, n=3, max_new=12), StepStore(None, "run", 0)  # type: ignore[arg-type]
    records = []
    for version in range(30):
        rids = rng.sample(sorted(table.requests), 5)
        for rid in rids:
            req = table.requests[rid]
            if req.done:
                continue
            if rng.random() < 0.1:
                table.migrate(rid, "death", keep_tokens=rng.random() < 0.5)
                continue
            at = max(0, len(req.token_ids) - rng.randint(0, 2))
            n = rng.randint(1, 3)
            tokens = [rng.randint(2, 90) for _ in range(n)]
            done = at + n >= 12
            apply_all(
                table,
                [
                    item(
                        rid,
                        at,
                        tokens,
                        lease=req.lease,
                        finished=done,
                        reason="length" if done else None,
                    )
                ],
                version=version // 4,
            )
        staged = StagedWrites()
        store.stage_requests(staged, table, set(rids))
        records += [a[1] for name, a, _ in staged.ops if name == "rpush"]
    arrays = replay(records)
    for req in table.requests.values():
        got = arrays.get((req.prompt_index, req.sample_index), Arrays())
        assert got.token_ids == req.token_ids
        assert got.logprobs == req.logprobs
        assert got.version_runs == req.version_runs


def test_a_log_record_with_a_gap_or_cut_short_is_refused():
    writer = RecordWriter()
    writer.add(0, 0, 2, [5], [-1.0], 0, [])  # from offset 2 of a request that holds nothing
    with pytest.raises(ValueError, match="gap"):
        replay([writer.record()])
    writer = RecordWriter()
    writer.add(0, 0, 0, [5], [-1.0], 0, [(0, 1)])
    with pytest.raises(ValueError):
        replay([writer.record()[:-3]])


def test_the_garbage_collector_is_off_while_a_read_is_taken_and_on_after():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("a read that failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # it was off before: left off
    finally:
        gc.enable()


def test_a_flush_time_is_its_stream_entry_ids_milliseconds():
    assert entry_time_s(b"1700000000123-7") == pytest.approx(1_700_000_000.123)

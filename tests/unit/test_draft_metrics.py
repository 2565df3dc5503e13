"""Speculative decoding's counts on their way from the engine to a step's metrics row: the
transformers engine marks the first token of each drafted forward pass, the worker's
DeltaBuffer sends the counts with those tokens, the request table adds them once (a resent
delta is not counted twice), the shards' summaries add up, and the row says drafted, accepted,
wasted and accepted per forward pass (nothing where no draft was verified)."""

import pytest

from services.contracts.sampling import SamplingParams
from services.coordinator.step.record import ShardSummary, rollout_row
from services.core.seeding import StepTimes
from services.rollout.delta_buffer import DeltaBuffer
from services.rollout.engines.hf import HFEngine
from tests import factories

PROMPT, BUDGET = [5, 6, 7, 8], 16


@pytest.fixture(scope="module")
def engine(tiny_model):
    e = HFEngine(draft_tokens=4, column_cost=0.0)
    e.load_weights(tiny_model)
    return e


def generate(engine, table, drafts) -> tuple[list, DeltaBuffer]:
    """The table's jobs run on `engine` (drafted from `drafts(request id)`), every step's
    events recorded in a DeltaBuffer; the flushes it took, and the buffer."""
    buf = DeltaBuffer("w1", flush_steps=3, flush_ms=1e9, now_s=0.0)
    for job in table.initial_jobs():
        job = job.replace(drafts=drafts(job.request_id))
        buf.start(job, job.request_id.encode())
        engine.add(job)
    flushes = []
    while engine.active:
        buf.record_step(engine.decode())
        if buf.flush_due(0.0):
            flushes.append(buf.take(0.0, version=0))
            buf.sent(flushes[-1])
    if (last := buf.take(0.0, version=0)) is not None:
        flushes.append(last)
    return flushes, buf


def row_of(table) -> dict:
    times = StepTimes(1, 1, 0.0, None, 2.0, 3.0, 1.0, 0.0)
    summary = ShardSummary.total([ShardSummary.of(table, 0)])
    pools = {"reserved": 1, "preemptible": 1}
    row = rollout_row(0, summary, times, 1.0, pools, 1.0, {})
    return {
        name: getattr(row, name)
        for name in ("drafted_tokens", "accepted_tokens", "wasted_tokens", "accepted_per_forward")
    }


def test_drafted_tokens_reach_the_steps_row_once_each(engine):
    sampling = SamplingParams(max_new_tokens=BUDGET, temperature=1.0)
    plain_table = factories.table([PROMPT], 3, sampling=sampling, stops=())
    plain, _ = generate(engine, plain_table, lambda rid: [])
    assert all(i.draft_forwards == 0 for f in plain for i in f.batch.items)
    for f in plain:
        plain_table.apply_all(f.batch.items)
    assert set(row_of(plain_table).values()) == {None}  # nothing drafted: no fields

    responses = {rid: list(r.token_ids) for rid, r in plain_table.requests.items()}
    table = factories.table([PROMPT], 3, sampling=sampling, stops=())
    flushes, _ = generate(engine, table, lambda rid: [responses[rid]])  # its own plain tokens
    sent = [i for f in flushes for i in f.batch.items]
    forwards, drafted, accepted = (
        sum(getattr(i, n) for i in sent) for n in ("draft_forwards", "drafted", "accepted")
    )
    assert drafted == accepted > 0 and forwards < sum(len(i.token_ids) for i in sent)
    for f in flushes:
        table.apply_all(f.batch.items)
        table.apply_all(f.batch.items)  # resent (a flush whose reply was lost): no new tokens
    assert {rid: r.token_ids for rid, r in table.requests.items()} == responses
    assert (table.draft_forwards, table.drafted, table.accepted) == (forwards, drafted, accepted)
    row = row_of(table)
    assert row == {
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "wasted_tokens": 0,
        "accepted_per_forward": pytest.approx(accepted / forwards),
    }

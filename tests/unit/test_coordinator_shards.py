"""Coordinator shards (issue 22, `contracts.shards`): which shard owns which request, how a
worker's flush is split between them, each shard's request table, and the step's summary added
up over the shards. The shards as real processes, killed, are `tests/integration/
test_coordinator_shards.py`."""

import pytest
from pydantic import ValidationError

from services.contracts import keys
from services.contracts.messages import DeltaBatch, DeltaItem, RequestLease
from services.contracts.runspec import RunSpec
from services.contracts.sampling import SamplingParams
from services.contracts.shards import MAX_COORDINATOR_SHARDS, shard_of, shard_of_prompt
from services.coordinator.step.record import ShardSummary
from services.core.collect import split_by_shard
from services.core.request_table import RequestTable, request_id
from tests import factories
from tests.conftest import apply


def item(rid: str, offset: int = 0) -> DeltaItem:
    return DeltaItem(
        request_id=rid, lease=0, grant="", offset=offset, token_ids=[5], logprobs=[-1.0]
    )


def table(shard: int, shards: int, prompts: int = 7, group: int = 3) -> RequestTable:
    prompt_ids = [[1, p] for p in range(prompts)]
    sampling = SamplingParams()
    return factories.table(prompt_ids, group, step=2, sampling=sampling, shard=shard, shards=shards)


def test_a_request_belongs_to_the_shard_of_its_prompt():
    assert [shard_of_prompt(p, 3) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert shard_of(request_id(4, 5, 2), 3) == 2
    assert shard_of(request_id(4, 5, 2), 1) == 0
    assert shard_of("not-a-request", 3) == 0  # dropped as unknown by shard 0, as ever
    assert shard_of("4:x:1", 3) == 0


def test_a_flush_goes_to_the_shards_of_its_requests_deltas_before_releases_in_order():
    items = [item(request_id(1, p, s), offset=p) for p in range(5) for s in range(2)]
    released = [RequestLease(request_id=request_id(1, p, 0), lease=3) for p in (4, 2, 1)]
    batch = DeltaBatch(
        worker_id="w", version=1, items=items, released=released, release_reason="balance"
    )
    assert split_by_shard(batch, 1) == {0: batch}
    parts = split_by_shard(batch, 2)
    assert sorted(parts) == [0, 1]
    for shard, part in parts.items():
        assert part.worker_id == "w" and part.version == 1 and part.release_reason == "balance"
        assert [i.request_id for i in part.items] == [
            i.request_id for i in items if shard_of(i.request_id, 2) == shard
        ]
        assert [r.request_id for r in part.released] == [
            r.request_id for r in released if shard_of(r.request_id, 2) == shard
        ]
    assert sum(len(p.items) for p in parts.values()) == len(items)
    # a shard with releases only still gets its batch
    only = DeltaBatch(worker_id="w", version=1, items=[], released=released[:1])
    assert list(split_by_shard(only, 2)) == [0]


def test_each_shard_holds_the_requests_of_its_prompts_and_their_jobs_say_the_shards():
    shards = [table(i, 3) for i in range(3)]
    whole = table(0, 1)
    assert sorted(r for t in shards for r in t.requests) == sorted(whole.requests)
    for i, t in enumerate(shards):
        assert {r.prompt_index % 3 for r in t.requests.values()} == {i}
        assert t.pending_groups == {p for p in range(7) if p % 3 == i}
        assert t.groups == len(t.pending_groups)
        assert t.requests_of_shard(i) == len(t.requests)
        assert {job.shards for job in t.initial_jobs()} == {3}
        assert whole.requests_of_shard(0) == len(whole.requests)
    assert [shards[0].requests_of_shard(i) for i in range(3)] == [9, 6, 6]
    assert {job.shards for job in whole.initial_jobs()} == {1}


def test_the_step_summary_adds_up_the_shards():
    tables = [table(i, 2) for i in range(2)]
    for t in tables:
        for rid in t.requests:
            apply(t, item(rid))
        t.score({rid: float(t.shard + 1) for rid in t.requests})
        t.migrations["death"] = 2
    firsts = [{}, {"reward": "raised: ValueError: x (at r.py:3 in score)"}]
    parts = [
        ShardSummary.of(t, t.shard, reward_calls=10, first_errors=f)
        for t, f in zip(tables, firsts, strict=True)
    ]
    total = ShardSummary.total(parts)
    assert total.requests == 21 and total.response_tokens == 21
    assert total.migrations == {"death": 4} and total.reward_errors == 1
    # the whole step's calls of user code, as the leader judges them (core.call_errors)
    reward = total.call_counts()["reward"]
    assert (reward.calls, reward.failed, reward.first) == (20, 1, firsts[1]["reward"])
    # the mean of every scored response, not the mean of the shards' means
    assert total.mean_reward == pytest.approx((12 * 1.0 + 9 * 2.0) / 21)


def test_shard_zero_keeps_the_names_of_one_coordinator_and_the_shard_count_is_bounded():
    run = "r1"
    assert keys.deltas_stream(run, 0) == keys.deltas_stream(run) == "spotrl:run:r1:deltas"
    assert keys.step_requests(run, 3, 0) == "spotrl:run:r1:step:3:requests"
    assert keys.deltas_stream(run, 2) == "spotrl:run:r1:deltas:shard:2"
    assert len(set(keys.all_deltas_streams(run))) == MAX_COORDINATOR_SHARDS
    for bad in (0, MAX_COORDINATOR_SHARDS + 1):
        with pytest.raises(ValidationError, match="coordinator_shards"):
            RunSpec(model="/m", coordinator_shards=bad)

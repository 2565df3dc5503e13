"""core.reclaim: which readers are dead, and what becomes of the jobs claimed from one (moved
on this shard's table under the lease each carried, handed to the shard that holds it, or
dropped), with no Redis."""

from services.contracts.messages import DeltaItem
from services.core.reclaim import expired_readers, plan_reclaim
from tests import factories
from tests.conftest import apply


def table(shard=0, shards=1, prompts=4):
    return factories.table(prompts, 2, 5, shard=shard, shards=shards)


def test_a_reader_is_dead_when_it_holds_jobs_and_has_no_heartbeat():
    pending = {"w1": 3, "w2": 0, "w3": 2, "coordinator": 1}
    assert expired_readers(pending, alive={"w3"}) == ["w1", "coordinator"]


def test_jobs_of_a_dead_worker_move_under_their_lease_and_keep_tokens_with_migration():
    t = table()
    apply(
        t,
        DeltaItem(
            request_id="0:0:0", lease=0, grant="", offset=0, token_ids=[5, 6], logprobs=[0, 0]
        ),
    )
    jobs = [t.job("0:0:0"), t.job("0:1:1")]
    t.migrate("0:1:1", "balance")  # moved on since: its old lease is stale
    plan = plan_reclaim(t, "w1", jobs, migration=True, claimer="coordinator")
    assert [j.request_id for j in plan.moved] == ["0:0:0"]
    assert plan.moved[0].lease == 1 and plan.moved[0].prefix_ids == [5, 6]
    assert plan.dead and not plan.handed
    assert t.migrations["death"] == 1


def test_without_migration_a_dead_workers_request_starts_over():
    t = table()
    apply(
        t,
        DeltaItem(
            request_id="0:0:0", lease=0, grant="", offset=0, token_ids=[5, 6], logprobs=[0, 0]
        ),
    )
    plan = plan_reclaim(t, "w1", [t.job("0:0:0")], migration=False, claimer="coordinator")
    assert plan.moved[0].lease == 1 and t.tokens_discarded == 2


def test_requests_of_another_shard_are_handed_to_it_as_released_by_the_dead_worker():
    t0, t1 = table(0, 2), table(1, 2)
    theirs = t1.job("0:1:0")
    plan = plan_reclaim(t0, "w1", [t0.job("0:0:0"), theirs], migration=True, claimer="c")
    assert [j.request_id for j in plan.moved] == ["0:0:0"]
    batch = plan.handed[1]
    assert batch.worker_id == "w1" and batch.release_reason == "death"
    assert [(x.request_id, x.lease) for x in batch.released] == [("0:1:0", 0)]
    assert plan.handed_count == 1


def test_jobs_pending_under_the_claimer_are_reclaimed_without_a_death():
    t = table()
    plan = plan_reclaim(t, "coordinator", [t.job("0:0:0")], migration=True, claimer="coordinator")
    assert not plan.dead and len(plan.moved) == 1

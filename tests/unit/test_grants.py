"""Lease grants (issue 41, part 4): every lease of a request has a random secret that only its
job carries. A delta or a release under the current lease is taken only with that grant; one
without it is refused and counted, and changes nothing (no token, no migration, no crash). A new
lease (a migration, a multi-turn episode's next turn) has a new grant; the worker echoes the
grant of the job it read (`DeltaBuffer`)."""

from services.contracts.messages import DeltaBatch, DeltaItem, RequestLease
from services.core.collect import CollectRules, apply_batches
from services.core.episodes import Observation
from services.core.request_table import Applied
from services.rollout.delta_buffer import DeltaBuffer
from tests import factories
from tests.factories import job as make_job
from tests.unit.test_collect import replace_step
from tests.unit.test_delta_buffer import Tok
from tests.unit.test_request_table import delta, table

RID = "0:0:0"
FORGED = "0" * 16


def test_a_delta_with_the_lease_but_not_its_grant_is_dropped_and_counted():
    t = table(max_new=5)
    holder = t.job(RID)
    assert len(holder.grant) == 16 and holder.grant == t.requests[RID].grant
    forged = delta(RID, 0, [6, 6, 6], finished=True, reason="stop").replace(grant=FORGED)
    assert t.apply(forged) is Applied.WRONG_GRANT
    assert t.apply(forged.replace(grant="")) is Applied.WRONG_GRANT
    r = t.requests[RID]
    assert r.token_ids == [] and not r.done and t.tokens_appended == 0
    assert t.stats["wrong_grant"] == 2
    assert t.apply(delta(RID, 0, [5, 6]).replace(grant=holder.grant)) is Applied.APPENDED
    assert r.token_ids == [5, 6]


def test_a_read_counts_the_refused_deltas_and_releases_by_worker():
    t = table(n=2, prompts=1, max_new=5)
    grant = t.requests["0:0:1"].grant
    honest = DeltaBatch(
        worker_id="w1",
        version=0,
        items=[delta("0:0:1", 0, [1]).replace(grant=grant)],
        released=[RequestLease(request_id="0:0:1", lease=0, grant=grant)],
        release_reason="balance",
    )
    intruder = DeltaBatch(
        worker_id="w2",
        version=0,
        items=[delta(RID, 0, [9]).replace(grant=FORGED)],
        released=[RequestLease(request_id=RID, lease=0, grant=FORGED)],
        release_reason="balance",
    )
    out = apply_batches(t, [honest, intruder], CollectRules())
    assert out.forged == {"w2": 2} and out.forged_releases == 1
    assert out.applied == {"appended": 1, "wrong_grant": 1}
    assert [job.request_id for job in out.released["balance"]] == ["0:0:1"]  # w1's only
    assert t.requests[RID].lease == 0 and t.requests[RID].token_ids == []
    assert out.changed == {"0:0:1"} and out.stale == {}


def test_a_release_without_the_grant_cannot_move_a_request_or_make_it_poison():
    t = table(n=1, prompts=1, max_new=5)
    rules = CollectRules(max_request_crashes=1)
    for reason in ("crash", "preemption", "death"):
        forged = DeltaBatch(
            worker_id="w9",
            version=0,
            items=[],
            released=[RequestLease(request_id=RID, lease=0, grant=FORGED)],
            release_reason=reason,
        )
        out = apply_batches(t, [forged], rules)
        assert out.released == {} and out.poisoned == [] and out.forged == {"w9": 1}
    r = t.requests[RID]
    assert r.lease == 0 and r.crashed_on == [] and not t.quarantined


def test_out_of_bound_deltas_without_the_grant_move_nothing():
    t = replace_step(table(n=1, prompts=1), step=2)
    rid = "2:0:0"
    old = DeltaBatch(worker_id="w", version=0, items=[delta(rid, 0, [1]).replace(grant=FORGED)])
    out = apply_batches(t, [old], CollectRules(max_staleness=1))
    assert out.released == {} and out.forged == {"w": 1} and out.applied == {"wrong_grant": 1}
    assert t.requests[rid].lease == 0


def test_a_migration_makes_a_new_grant_and_the_old_holders_deltas_are_dropped():
    t = table(max_new=5)
    old = t.job(RID)
    assert t.apply(delta(RID, 0, [5]).replace(grant=old.grant)) is Applied.APPENDED
    new = t.migrate(RID, "preemption")
    assert new is not None and new.lease == 1 and new.grant != old.grant
    assert t.requests[RID].grant == new.grant
    # the old holder: under its own lease, stale (and fenced); under the new one it lacks the grant
    assert t.apply(delta(RID, 1, [6]).replace(grant=old.grant)) is Applied.STALE_LEASE
    assert t.apply(delta(RID, 1, [6], lease=1).replace(grant=old.grant)) is Applied.WRONG_GRANT
    assert t.apply(delta(RID, 1, [7], lease=1).replace(grant=new.grant)) is Applied.APPENDED
    assert t.requests[RID].token_ids == [5, 7]
    # and its release under the new lease is refused too
    assert t.wrong_grant(RID, 1, old.grant) and not t.wrong_grant(RID, 1, new.grant)
    assert not t.wrong_grant(RID, 0, old.grant)  # an old lease: for the usual fencing


def test_every_lease_of_every_request_has_its_own_grant():
    t = table(n=4, prompts=4)
    grants = {j.grant for j in t.initial_jobs()}
    assert len(grants) == 16
    t.migrate(RID, "balance")
    t.migrate(RID, "balance")
    assert t.requests[RID].grant not in grants


def test_the_next_turn_of_an_episode_has_a_new_grant():
    t = factories.table([[7, 8]], 1, 16, step=1, seed=5, max_turns=3)
    rid = "1:0:0"
    first = t.job(rid)
    done = DeltaItem(
        request_id=rid,
        lease=0,
        grant=first.grant,
        offset=0,
        token_ids=[3, 0],
        logprobs=[0.0, 0.0],
        finished=True,
        finish_reason="stop",
    )
    assert t.apply(done) is Applied.TURN_ENDED
    turn = t.observe(rid, 0, Observation([4], 0.0, False))
    assert turn is not None and turn.lease == 1 and turn.grant != first.grant
    assert t.apply(done.replace(lease=1, offset=3, token_ids=[5])) is Applied.WRONG_GRANT


def test_the_worker_echoes_its_jobs_grant_in_every_delta_and_release():
    buf = DeltaBuffer("w1", flush_steps=1, flush_ms=1e9, now_s=0.0)
    buf.start(make_job("a", [1, 2], 8, lease=2, grant="feed"), b"e-a")
    buf.record_step([Tok("a", 5)])
    flush = buf.take(0.0, version=0, released=buf.running(), reason="balance")
    assert flush is not None
    (item,) = flush.batch.items
    assert (item.lease, item.grant) == (2, "feed")
    assert flush.batch.released == [RequestLease(request_id="a", lease=2, grant="feed")]

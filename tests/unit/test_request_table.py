from services.contracts.messages import DeltaItem
from services.core.request_table import Applied
from tests import factories
from tests.conftest import apply


def table(n=2, prompts=2, max_new=5):
    return factories.table(prompts, n, max_new)


def delta(rid, offset, tokens, lease=0, finished=False, reason=None):
    return DeltaItem(
        request_id=rid,
        lease=lease,
        grant="",
        offset=offset,
        token_ids=tokens,
        logprobs=[-0.5] * len(tokens),
        finished=finished,
        finish_reason=reason,
    )


def test_jobs_cover_every_sample_of_every_prompt():
    t = table(n=3, prompts=2)
    assert sorted(j.request_id for j in t.initial_jobs()) == [
        "0:0:0",
        "0:0:1",
        "0:0:2",
        "0:1:0",
        "0:1:1",
        "0:1:2",
    ]
    assert len({j.seed for j in t.initial_jobs()}) == 6


def test_tokens_append_in_order_and_once():
    t = table()
    assert apply(t, delta("0:0:0", 0, [5, 6])) is Applied.APPENDED
    assert apply(t, delta("0:0:0", 0, [5, 6])) is Applied.DUPLICATE
    assert apply(t, delta("0:0:0", 1, [6, 7])) is Applied.APPENDED  # overlap trimmed
    assert t.requests["0:0:0"].token_ids == [5, 6, 7]
    assert len(t.requests["0:0:0"].logprobs) == 3


def test_gap_is_refused():
    t = table()
    assert apply(t, delta("0:0:0", 2, [5])) is Applied.GAP
    assert t.requests["0:0:0"].token_ids == []


def test_stale_lease_is_fenced_after_migration():
    t = table()
    apply(t, delta("0:0:0", 0, [5, 6]))
    job = t.migrate("0:0:0", "preemption")
    assert job.lease == 1 and job.prefix_ids == [5, 6] and job.remaining_tokens == 3
    assert apply(t, delta("0:0:0", 2, [9], lease=0)) is Applied.STALE_LEASE
    assert apply(t, delta("0:0:0", 2, [7], lease=1)) is Applied.APPENDED
    assert t.requests["0:0:0"].token_ids == [5, 6, 7]


def test_finished_response_never_changes_and_groups_complete():
    t = table(n=2, prompts=1)
    assert apply(t, delta("0:0:0", 0, [5, 0], finished=True, reason="stop")) is Applied.FINISHED
    assert apply(t, delta("0:0:0", 2, [7])) is Applied.ALREADY_DONE
    assert not t.group_done(0)
    assert t.migrate("0:0:0", "preemption") is None
    apply(t, delta("0:0:1", 0, [1, 2, 3, 4, 5]))
    assert t.requests["0:0:1"].finish_reason == "length"  # budget reached
    assert t.group_done(0)


def test_tokens_beyond_the_budget_are_cut():
    t = table(max_new=3)
    assert apply(t, delta("0:0:0", 0, [1, 2, 3, 4, 5])) is Applied.FINISHED
    assert t.requests["0:0:0"].token_ids == [1, 2, 3]


def test_unknown_request():
    assert apply(table(), delta("9:9:9", 0, [1])) is Applied.UNKNOWN


def test_migration_with_a_lease_moves_only_the_current_holder():
    t = table()
    assert t.migrate("0:0:0", "death", lease=3) is None  # already moved on
    assert t.migrate("0:0:0", "death", lease=0).lease == 1
    assert t.migrate("0:0:0", "preemption", lease=0) is None  # a late release: no-op
    assert t.migrations == {"death": 1}


def test_restart_without_migration_discards_collected_tokens():
    t = table(max_new=5)
    apply(t, delta("0:0:0", 0, [5, 6, 7]))
    job = t.migrate("0:0:0", "preemption", keep_tokens=False)
    assert job.prefix_ids == [] and job.remaining_tokens == 5 and job.lease == 1
    assert t.tokens_discarded == 3 and t.requests["0:0:0"].token_ids == []
    apply(t, delta("0:0:0", 0, [8, 9], lease=1))
    assert t.requests["0:0:0"].token_ids == [8, 9]
    assert t.tokens_received == 5 and t.tokens_appended == 5


def test_unfinished_count_follows_finishes_quarantines_and_migrations():
    t = table(n=2, prompts=2, max_new=3)
    assert t.unfinished_count == len(t.unfinished()) == 4
    apply(t, delta("0:0:0", 0, [5, 6, 7]))  # reaches max_new_tokens
    apply(t, delta("0:0:1", 0, [5], finished=True, reason="stop"))
    assert t.unfinished_count == len(t.unfinished()) == 2
    apply(t, delta("0:0:1", 1, [9], finished=True, reason="stop"))  # already done: no change
    t.migrate("0:1:0", "death", keep_tokens=False)
    assert t.unfinished_count == len(t.unfinished()) == 2
    t.quarantine(1)
    t.quarantine(1)
    assert t.unfinished_count == len(t.unfinished()) == 0


def test_a_delta_that_repeats_and_overruns_is_cut_to_what_fits():
    t = table(n=1, prompts=1, max_new=4)
    assert apply(t, delta("0:0:0", 0, [1, 2])) is Applied.APPENDED
    assert apply(t, delta("0:0:0", 1, [2, 3, 4, 5, 6])) is Applied.FINISHED
    r = t.requests["0:0:0"]
    assert r.token_ids == [1, 2, 3, 4] and len(r.logprobs) == 4 and r.finish_reason == "length"


def test_every_token_keeps_the_version_that_generated_it():
    t = table(max_new=6)
    apply(t, delta("0:0:0", 0, [5, 6]))  # the table's version (0)
    apply(t, delta("0:0:0", 2, [7]), version=0)
    apply(t, delta("0:0:0", 1, [6, 7, 8]), version=1)  # repeats two tokens: only 8 is new
    t.migrate("0:0:0", "preemption")  # a continuation, on a worker with a newer version
    apply(t, delta("0:0:0", 4, [9, 0], lease=1, finished=True, reason="stop"), version=2)
    assert t.requests["0:0:0"].version_runs == [(0, 0), (3, 1), (4, 2)]
    apply(t, delta("0:0:1", 0, [1, 2]), version=3)
    t.migrate("0:0:1", "death", keep_tokens=False)  # starts over: its old runs go too
    apply(t, delta("0:0:1", 0, [3], lease=1, finished=True, reason="stop"), version=4)
    t.score({"0:0:0": 1.0, "0:0:1": 0.0})
    group = t.group_message(0)
    assert [r.version_runs for r in group.responses] == [[(0, 0), (3, 1), (4, 2)], [(0, 4)]]

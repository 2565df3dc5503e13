"""core.episodes: multi-turn episodes on the request table. A model turn is collected token by
token (fenced, appended once, migrated); its end waits for the environment; the observation is
appended as not generated and the next turn is a continuation job; the episode's reward is the
sum of its turns'."""

import pytest

from services.contracts.messages import DeltaBatch, DeltaItem
from services.core.collect import CollectRules
from services.core.episodes import EpisodeTable, Observation
from services.core.request_table import Applied
from tests import factories
from tests.conftest import apply, apply_held

EOS = 0


def table(max_turns: int = 3, budget: int = 16, group_size: int = 2) -> EpisodeTable:
    return factories.table(
        [[7, 8]], group_size, budget, step=1, seed=5, stops=[EOS], max_turns=max_turns
    )


def delta(rid: str, lease: int, offset: int, tokens: list[int], finished=False) -> DeltaItem:
    return DeltaItem(
        request_id=rid,
        lease=lease,
        grant="",
        offset=offset,
        token_ids=tokens,
        logprobs=[-0.5] * len(tokens),
        finished=finished,
        finish_reason="stop" if finished else None,
    )


RID = "1:0:0"


def test_a_turn_ends_waiting_for_the_environment_and_takes_no_more_deltas():
    t = table()
    assert apply(t, delta(RID, 0, 0, [3, 4])) is Applied.APPENDED
    assert apply(t, delta(RID, 0, 2, [EOS], finished=True)) is Applied.TURN_ENDED
    r = t.requests[RID]
    assert r.awaiting == "stop" and not r.done and t.unfinished_count == 2
    assert t.awaiting() == [RID]
    assert apply(t, delta(RID, 0, 3, [9])) is Applied.ALREADY_DONE
    assert t.migrate(RID, "balance") is None  # no job of it is out: nothing to move


def test_an_observation_is_appended_as_not_generated_and_the_next_turn_continues_it():
    t = table()
    apply(t, delta(RID, 0, 0, [3, EOS], finished=True))
    job = t.observe(RID, 0, Observation([50, 51, 52], reward=0.0, done=False))
    assert job is not None and job.lease == 1 and job.prefix_ids == [3, EOS, 50, 51, 52]
    assert job.remaining_tokens == 16 - 5
    r = t.requests[RID]
    assert r.observed == [(2, 3)] and r.awaiting is None and r.logprobs[2:] == [0.0] * 3
    assert apply(t, delta(RID, 0, 5, [6])) is Applied.STALE_LEASE  # the old turn's lease
    assert apply(t, delta(RID, 1, 5, [6, EOS], finished=True)) is Applied.TURN_ENDED
    assert t.turns(RID) == [[3, EOS], [6, EOS]] and t.generated_tokens(RID) == 4
    assert t.observe(RID, 1, Observation([60], reward=1.0, done=True)) is None
    assert r.done and r.finish_reason == "stop" and r.reward == 1.0
    assert r.token_ids == [3, EOS, 50, 51, 52, 6, EOS]  # the last observation is not kept


def test_the_reward_is_the_sum_of_the_turns_and_max_turns_ends_the_episode():
    t = table(max_turns=2)
    apply(t, delta(RID, 0, 0, [3, EOS], finished=True))
    assert t.observe(RID, 0, Observation([50], reward=0.25, done=False)) is not None
    apply(t, delta(RID, 1, 3, [4, EOS], finished=True))
    assert t.observe(RID, 1, Observation([50], reward=0.5, done=False)) is None  # 2 turns
    assert t.requests[RID].reward == 0.75 and t.episodes[RID].turns == 2


def test_an_observation_that_leaves_no_room_in_the_budget_ends_the_episode():
    t = table(budget=6)
    apply(t, delta(RID, 0, 0, [3, 4, EOS], finished=True))
    assert t.observe(RID, 0, Observation([50, 51, 52], reward=0.0, done=False)) is None
    assert t.requests[RID].done and t.requests[RID].observed == []


def test_a_turn_cut_by_the_budget_still_waits_for_the_environment():
    t = table(budget=4)
    assert apply(t, delta(RID, 0, 0, [3, 4, 5, 6])) is Applied.TURN_ENDED
    assert t.requests[RID].awaiting == "length"
    assert t.observe(RID, 0, Observation([], reward=0.5, done=False)) is None
    assert t.requests[RID].finish_reason == "length" and t.requests[RID].reward == 0.5


def test_a_stale_or_unawaited_answer_changes_nothing():
    t = table()
    assert t.observe(RID, 0, Observation([1], 1.0, True)) is None  # its turn is not over
    apply(t, delta(RID, 0, 0, [3, EOS], finished=True))
    assert t.observe(RID, 5, Observation([1], 1.0, True)) is None  # another lease
    assert t.requests[RID].awaiting == "stop" and not t.requests[RID].done


def test_a_turn_migrates_mid_way_and_continues_on_another_worker():
    t = table()
    apply(t, delta(RID, 0, 0, [3, EOS], finished=True))
    t.observe(RID, 0, Observation([50], reward=0.0, done=False))
    apply(t, delta(RID, 1, 3, [4]))  # the second turn, part way
    job = t.migrate(RID, "preemption", lease=1)
    assert job is not None and job.lease == 2 and job.prefix_ids == [3, EOS, 50, 4]
    assert apply(t, delta(RID, 2, 4, [EOS], finished=True)) is Applied.TURN_ENDED
    assert t.turns(RID) == [[3, EOS], [4, EOS]]


def test_groups_complete_when_every_episode_is_over():
    t = table(group_size=2)
    for s in range(2):
        rid = f"1:0:{s}"
        apply(t, delta(rid, 0, 0, [3, EOS], finished=True))
        assert t.completed_groups([rid]) == []
        t.observe(rid, 0, Observation([], reward=float(s), done=True))
    assert t.completed_groups(["1:0:1"]) == [0] and t.unfinished_count == 0
    rewards = [resp.reward for resp in t.group_message(0).responses]
    assert rewards == [0.0, 1.0]


def test_max_turns_must_be_positive():
    with pytest.raises(ValueError, match="max_turns"):
        table(max_turns=0)


def test_a_read_of_deltas_names_the_turns_that_ended():
    t = table()
    flush = DeltaBatch(
        worker_id="w",
        version=1,
        items=[delta(RID, 0, 0, [3, EOS], finished=True), delta("1:0:1", 0, 0, [4])],
    )
    out = apply_held(t, [flush], CollectRules())
    assert out.turn_ended == [RID] and out.finished == [] and out.changed == {RID, "1:0:1"}


def test_the_trainer_gets_the_spans_the_model_did_not_generate():
    t = table(group_size=1)
    apply(t, delta(RID, 0, 0, [3, EOS], finished=True))
    t.observe(RID, 0, Observation([50, 51], reward=0.0, done=False))
    apply(t, delta(RID, 1, 4, [4, EOS], finished=True))
    t.observe(RID, 1, Observation([], reward=1.0, done=True))
    [response] = t.group_message(0).responses
    assert response.token_ids == [3, EOS, 50, 51, 4, EOS] and response.observed == [(2, 2)]
    assert response.reward == 1.0


def test_without_migration_a_preempted_episode_starts_over_whole():
    t = table()
    apply(t, delta(RID, 0, 0, [3, EOS], finished=True))
    t.observe(RID, 0, Observation([50], reward=0.0, done=False, text=" no", role="user"))
    apply(t, delta(RID, 1, 3, [4]))
    job = t.migrate(RID, "preemption", keep_tokens=False, lease=1)
    assert job is not None and job.prefix_ids == [] and job.remaining_tokens == 16
    r = t.requests[RID]
    assert r.token_ids == [] and r.observed == [] and t.tokens_discarded == 3
    assert t.episodes[RID].turns == 1 and t.episodes[RID].said == []


def test_an_empty_observation_adds_no_span():
    t = table()
    apply(t, delta(RID, 0, 0, [3, EOS], finished=True))
    job = t.observe(RID, 0, Observation([], reward=0.0, done=False))
    assert job is not None and job.prefix_ids == [3, EOS] and t.requests[RID].observed == []
    apply(t, delta(RID, 1, 2, [4, EOS], finished=True))
    assert t.turns(RID) == [[3, EOS], [4, EOS]]  # two turns all the same

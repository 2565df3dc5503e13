"""Drafts from history: the suffix matcher (rollout/drafts.py) and the bounds on `Job.drafts`."""

import msgspec
import pytest

from services.contracts.messages import (
    MAX_DRAFT_REFERENCES,
    MAX_DRAFT_TOKENS,
    Job,
    MalformedMessage,
)
from services.rollout.drafts import MAX_REFERENCE_TOKENS, MAX_REFERENCES, DraftIndex
from tests.factories import job


def test_the_longest_matching_suffix_gives_the_draft():
    index = DraftIndex([[1, 2, 3, 4, 5], [9, 2, 3, 7, 8]])
    assert index.propose([0, 2, 3], 2) == [7, 8]  # "2 3" in both: the latest reference
    assert index.propose([1, 2, 3], 2) == [4, 5]  # "1 2 3" only in the first: longer wins
    assert index.propose([9, 2, 3], 5) == [7, 8]  # no more than the reference holds
    assert index.propose([5], 3) == []  # the last token of a reference: nothing follows
    assert index.propose([6], 3) == []  # found nowhere
    assert index.propose([1, 2], 0) == [] and index.propose([], 3) == []


def test_the_match_is_at_most_max_ngram_long():
    index = DraftIndex([[1, 2, 3, 4, 50], [0, 2, 3, 4, 60]], max_ngram=2)
    assert index.propose([1, 2, 3, 4], 1) == [60]  # "3 4" is as far as it looks: the latest
    assert DraftIndex([[1, 2, 3, 4, 50], [0, 2, 3, 4, 60]]).propose([1, 2, 3, 4], 1) == [50]
    with pytest.raises(ValueError, match="max_ngram"):
        DraftIndex([[1, 2]], max_ngram=0)


def test_equal_matches_prefer_the_requests_own_position():
    """A run of one token matches all along itself: the draft lined up with the request's
    position continues the run, where the latest match would end it at once."""
    ref = [7] * 12 + [30]
    index = DraftIndex([ref])
    context = [1, 2] + [7] * 3
    assert index.propose(context, 4) == [30]  # no position: the latest match
    assert index.propose(context, 4, position=3) == [7, 7, 7, 7]
    assert index.propose([7] * 11, 4, position=11) == [7, 30]


def test_references_are_bounded_latest_kept():
    many = [[i, i + 1] for i in range(MAX_REFERENCES + 5)]
    assert DraftIndex(many).references == many[-MAX_REFERENCES:]
    big = [[1] * MAX_REFERENCE_TOKENS, [2] * 10, []]
    kept = DraftIndex(big).references
    assert kept[-1] == [2] * 10 and len(kept[0]) == MAX_REFERENCE_TOKENS - 10
    assert sum(len(r) for r in kept) == MAX_REFERENCE_TOKENS
    assert not DraftIndex([[], [4]])  # nothing to draft from: no token has one after it


def test_a_job_without_drafts_decodes_and_drafts_are_bounded():
    j = job("0:0:0", [1, 2], 4)
    raw = msgspec.msgpack.decode(j.encode())
    del raw["drafts"]  # an entry of a release before drafts
    assert Job.decode(msgspec.msgpack.encode(raw)).drafts == []
    with_drafts = j.replace(drafts=[[3, 4], [5]])
    assert Job.decode(with_drafts.encode()).drafts == [[3, 4], [5]]
    raw["drafts"] = [[1]] * (MAX_DRAFT_REFERENCES + 1)
    with pytest.raises(MalformedMessage, match="drafts"):
        Job.decode(msgspec.msgpack.encode(raw))
    raw["drafts"] = [[1] * (MAX_DRAFT_TOKENS // 2 + 1)] * 2
    with pytest.raises(MalformedMessage, match="drafts hold"):
        Job.decode(msgspec.msgpack.encode(raw))

"""Drafts refreshed as siblings finish, on a worker (services/rollout/sibling_drafts.py) with the
real transformers engine: a response finished here becomes a draft of its group's requests still
running here and of those that start later, the tokens stay those of plain decoding, another
group's or another run's requests draft nothing from it, and what it keeps is bounded."""

import pytest

from services.contracts.sampling import SamplingParams
from services.rollout import sibling_drafts
from services.rollout.engines.hf import HFEngine
from services.rollout.sibling_drafts import SiblingDrafts
from tests.factories import job

T1 = SamplingParams(temperature=1.0)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def engine(tiny_model):
    e = HFEngine(draft_tokens=5, column_cost=0.0)
    e.load_weights(tiny_model)
    return e


def run(engine, first, joins, share: bool):
    """`first` started at once, `joins` (step -> jobs) later; with `share`, through
    `SiblingDrafts`. Each request's tokens, the draft tokens each verified, the siblings
    refreshed, and the `SiblingDrafts`."""
    siblings = SiblingDrafts(engine.set_drafts) if share else None

    def holds(rid: str, lease: int) -> bool:
        return rid in engine.seqs

    def add(j):
        engine.add(j)
        if siblings is not None:
            siblings.started(j, holds)

    out: dict[str, list[int]] = {}
    drafted: dict[str, int] = {}
    refreshed, step, joins = 0, 0, dict(joins)
    for j in first:
        add(j)
    while engine.active or joins:
        for j in joins.pop(step, []):
            add(j)
        events = engine.decode()
        drafted |= {rid: s.drafted for rid, s in engine.request_stats.items()}
        for ev in events:
            out.setdefault(ev.request_id, []).append(ev.token_id)
        if siblings is not None:
            refreshed += siblings.record(events, holds)
        step += 1
    return out, drafted, refreshed, siblings


def test_a_finished_sibling_drafts_the_running_ones_and_tokens_stay_plain(engine):
    # 0:0:0 runs ahead; 0:0:1 and 0:0:2 (its group, the same seed: they draw what it drew) join
    # at step 10, with 0:1:0 (another group) and 0:0:3 of another run; 0:0:4 after it finished
    first = [job("0:0:0", PROMPT, 24, seed=1, sampling=T1)]
    joins = {
        10: [job(f"0:0:{s}", PROMPT, 24, seed=1, sampling=T1) for s in (1, 2)]
        + [job("0:1:0", PROMPT, 24, seed=1, sampling=T1)]
        + [job("0:0:3", PROMPT, 24, seed=1, sampling=T1, run_id="other")],
        30: [job("0:0:4", PROMPT, 24, seed=1, sampling=T1)],
    }
    engine.spec_stats.__init__()
    plain, _, _, _ = run(engine, first, joins, share=False)
    assert engine.spec_stats.drafted == 0  # no job carries drafts
    engine.spec_stats.__init__()
    shared, drafted, refreshed, siblings = run(engine, first, joins, share=True)
    assert shared == plain  # the same tokens, drafts or not
    assert refreshed >= 2  # 0:0:1 and 0:0:2 got 0:0:0's response while running
    assert drafted["0:0:1"] > 0 and drafted["0:0:2"] > 0 and drafted["0:0:4"] > 0
    assert drafted["0:1:0"] == 0 and drafted["0:0:3"] == 0  # another group, another run
    assert engine.spec_stats.accepted > 0 and engine.spec_stats.tokens_per_forward > 1.0
    assert set(siblings.finished) == {("r", "0:0"), ("r", "0:1"), ("other", "0:0")}
    assert siblings.running == {}  # every request ended: none followed


def test_the_finished_groups_kept_are_bounded(engine, monkeypatch):
    monkeypatch.setattr(sibling_drafts, "KEPT_GROUPS", 3)
    jobs = [job(f"0:{p}:0", PROMPT, 2, seed=p, sampling=T1) for p in range(5)]
    _, _, _, siblings = run(engine, jobs, {}, share=True)
    assert list(siblings.finished) == [("r", "0:2"), ("r", "0:3"), ("r", "0:4")]

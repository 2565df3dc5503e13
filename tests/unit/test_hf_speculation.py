"""The transformers engine's exact speculative decoding: with drafts (perfect, a sibling's,
wrong, partly right), every request yields the tokens, offsets and finish reasons plain decoding
yields, and logprobs equal up to float noise; good drafts yield several tokens per pass."""

import pytest

from services.contracts.sampling import SamplingParams
from services.rollout.engines.hf import HFEngine
from services.rollout.engines.speculation import DraftGate
from tests.factories import job

SAMPLINGS = {
    "t1": SamplingParams(temperature=1.0),
    "greedy": SamplingParams(temperature=0.0),
    "filters": SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
    "penalty": SamplingParams(temperature=1.0, repetition_penalty=1.3),
}
N = 6  # requests, prompts [5|6|7, 6, 7, 8]
BUDGET = 24


@pytest.fixture(scope="module")
def engine(tiny_model):
    e = HFEngine(draft_tokens=5, column_cost=0.0)  # every draft verified
    e.load_weights(tiny_model)
    return e


def run(engine, jobs, joins=None):
    """Each request's events as (offset, token, logprob, finish reason), in order."""
    out: dict[str, list] = {}
    joins = dict(joins or {})
    for j in jobs:
        engine.add(j)
    step = 0
    while engine.active or joins:
        for j in joins.pop(step, []):
            engine.add(j)
        for ev in engine.decode():
            out.setdefault(ev.request_id, []).append(
                (ev.offset, ev.token_id, ev.logprob, ev.finish_reason)
            )
        step += 1
    return out


def same_as(plain, spec):
    assert spec.keys() == plain.keys()
    for rid in plain:
        assert [e[:2] + e[3:] for e in spec[rid]] == [e[:2] + e[3:] for e in plain[rid]], rid
        for a, b in zip(spec[rid], plain[rid], strict=True):
            assert a[2] == pytest.approx(b[2], abs=1e-4)


def tokens(events):
    return [e[1] for e in events]


def group(sampling, n=BUDGET, stop=()):
    return [
        job(f"r{i}", [5 + i % 3, 6, 7, 8], n, seed=i, stop=stop, sampling=sampling)
        for i in range(N)
    ]


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_drafted_generation_yields_the_plain_tokens(engine, name):
    jobs = group(SAMPLINGS[name])
    plain = run(engine, jobs)
    done = [tokens(plain[j.request_id]) for j in jobs]
    cases = {
        "perfect": lambda i: [done[i]],
        "siblings": lambda i: done[:i] + done[i + 1 :],
        "wrong": lambda i: [[(t + 1) % 200 for t in done[i]]],
        "partial": lambda i: [done[i][:8] + [3] * 16],
    }
    for case, drafts in cases.items():
        engine.spec_stats.__init__()
        spec = run(engine, [j.replace(drafts=drafts(i)) for i, j in enumerate(jobs)])
        same_as(plain, spec)
        stats = engine.spec_stats
        assert stats.tokens == N * BUDGET and stats.drafted > 0, case
        if case == "perfect":
            assert stats.tokens_per_forward > 3.0
            assert stats.accepted == stats.drafted


def test_plain_and_drafted_rows_share_steps_as_requests_join_and_leave(engine):
    sampling = SAMPLINGS["t1"]
    jobs = group(sampling)
    plain = run(engine, jobs)
    drafted = [
        j.replace(drafts=[tokens(plain[j.request_id])]) if i % 2 else j for i, j in enumerate(jobs)
    ]
    short = job("s", [9, 10, 11], 3, seed=99, sampling=sampling)
    alone = run(engine, [short])
    spec = run(engine, drafted[:3], joins={2: drafted[3:], 5: [short]})
    same_as(plain | alone, spec)


def test_a_continuation_with_drafts_continues_with_the_same_tokens(engine):
    for sampling in (SAMPLINGS["t1"], SAMPLINGS["penalty"]):
        full = tokens(run(engine, [job("x", [5, 6, 7, 8], BUDGET, seed=3, sampling=sampling)])["x"])
        cont = job("x", [5, 6, 7, 8], BUDGET - 7, prefix=full[:7], seed=3, sampling=sampling)
        rest = run(engine, [cont.replace(drafts=[full])])["x"]
        assert full[:7] + tokens(rest) == full
        assert rest[0][0] == 7  # offsets count from the prefix


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_there(engine):
    sampling = SAMPLINGS["t1"]
    full = {j.request_id: tokens(run(engine, [j])[j.request_id]) for j in group(sampling)}
    # a token each request draws somewhere past its first few positions
    stop = next(t for t in full["r0"][6:] if t not in full["r0"][:6])
    jobs = group(sampling, stop=[stop])
    plain = run(engine, jobs)
    assert plain["r0"][-1][3] == "stop" and len(plain["r0"]) > 6
    spec = run(engine, [j.replace(drafts=[full[j.request_id]]) for j in jobs])
    same_as(plain, spec)


def test_budgets_are_exact_and_drafts_never_pass_them(engine):
    sampling = SAMPLINGS["greedy"]
    full = tokens(run(engine, [job("b", [5, 6, 7, 8], BUDGET, sampling=sampling)])["b"])
    for budget in (1, 2, 3, 7):
        j = job("b", [5, 6, 7, 8], budget, sampling=sampling, drafts=[full])
        out = run(engine, [j])["b"]
        assert tokens(out) == full[:budget] and out[-1][3] == "length"
        assert [e[3] for e in out[:-1]] == [None] * (budget - 1)


def test_drafts_refreshed_mid_run_and_per_request_counters(engine):
    sampling = SAMPLINGS["t1"]
    jobs = group(sampling)
    plain = run(engine, jobs)
    for j in jobs:
        engine.add(j)
    engine.decode()  # every request prefilled, no drafts yet
    assert all(s.drafted == 0 for s in engine.request_stats.values())
    for j in jobs:
        engine.set_drafts(j.request_id, [tokens(plain[j.request_id])])
    out: dict[str, list] = {}
    stats = {}
    while engine.active:
        stats |= {rid: s.tokens_per_forward for rid, s in engine.request_stats.items()}
        for ev in engine.decode():
            out.setdefault(ev.request_id, []).append(ev.token_id)
    assert [tokens(plain[j.request_id])[1:] for j in jobs] == [out[j.request_id] for j in jobs]
    assert engine.request_stats == {}  # finished requests are forgotten
    assert all(tpf > 1.5 for tpf in stats.values())


def test_draft_tokens_zero_turns_speculation_off(tiny_model):
    engine = HFEngine(draft_tokens=0)
    engine.load_weights(tiny_model)
    j = job("z", [5, 6, 7, 8], 8, sampling=SAMPLINGS["t1"])
    plain = run(engine, [j])
    assert run(engine, [j.replace(drafts=[tokens(plain["z"])])]) == plain
    assert engine.spec_stats.drafted == 0 and engine.spec_stats.tokens_per_forward == 1.0
    with pytest.raises(ValueError, match="draft_tokens"):
        HFEngine(draft_tokens=-1)


def test_rejected_positions_widen_the_cache_by_a_bounded_share(engine):
    """Wrong drafts leave hidden columns in the cache; it is compacted before they pass a
    quarter of its longest row (and HOLES_MIN), so it stays near plain decoding's width."""
    from services.rollout.engines.hf import HOLES_MIN, HOLES_SHARE

    jobs = group(SAMPLINGS["t1"], n=60)
    plain = run(engine, jobs)
    wrong = [j.replace(drafts=[[(t + 1) % 200 for t in tokens(plain[j.request_id])]]) for j in jobs]
    for j in wrong:
        engine.add(j)
    out: dict[str, list] = {}
    widest = 0
    while engine.active:
        for ev in engine.decode():
            out.setdefault(ev.request_id, []).append((ev.offset, ev.token_id, ev.logprob, None))
        if engine.active:
            longest = int(engine._attn.sum(dim=1).max())
            extra = engine._attn.shape[1] - longest
            assert extra <= max(HOLES_MIN, longest * HOLES_SHARE)
            widest = max(widest, extra)
    assert widest > 4  # holes were left, then compacted
    assert {r: tokens(e) for r, e in out.items()} == {r: tokens(e) for r, e in plain.items()}


def test_the_gate_drafts_only_where_drafts_pay_and_probes_again():
    gate = DraftGate(column_cost=0.2, acceptance=0.9)
    assert gate.drafts(drafted_tokens=4 * 8, rows=8, width=5)  # 3.6 tokens a row for 0.8
    for _ in range(10):
        gate.observe(drafted=32, accepted=0)  # every draft rejected: acceptance falls
    assert gate.acceptance < 0.1
    gated = [gate.drafts(drafted_tokens=32, rows=8, width=5) for _ in range(gate.probe_every + 1)]
    assert gated == [False] * gate.probe_every + [True]  # off, then one probe
    gate.observe(drafted=32, accepted=0)  # the probe missed: the next comes twice as late
    gated = [
        gate.drafts(drafted_tokens=32, rows=8, width=5) for _ in range(2 * gate.probe_every + 1)
    ]
    assert gated == [False] * 2 * gate.probe_every + [True]
    gate.observe(drafted=32, accepted=32)
    gate.observe(drafted=32, accepted=32)
    assert gate.drafts(drafted_tokens=32, rows=8, width=5)  # paying again: on


def test_a_gated_engine_keeps_the_plain_tokens_and_drafts_less(tiny_model):
    plain_engine, gated = HFEngine(draft_tokens=0), HFEngine(draft_tokens=5, column_cost=5.0)
    for e in (plain_engine, gated):
        e.load_weights(tiny_model)
    jobs = group(SAMPLINGS["t1"])
    plain = run(plain_engine, jobs)
    wrong = [[(t + 1) % 200 for t in tokens(plain[j.request_id])] for j in jobs]
    spec = run(gated, [j.replace(drafts=[w]) for j, w in zip(jobs, wrong, strict=True)])
    same_as(plain, spec)
    steps = max(len(v) for v in plain.values())
    assert 0 < gated.spec_stats.drafted <= 5 * N * (1 + steps // gated.gate.probe_every)

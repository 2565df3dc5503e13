"""Sampling knobs (top_k, repetition_penalty) from the run spec to the job to the transformers
engine's draw: the same filters as transformers, logprobs of the distribution drawn from, and
bounds checked where a job is decoded."""

import math

import msgspec
import pytest
import torch

from services.contracts.messages import Job, MalformedMessage
from services.contracts.sampling import SamplingParams
from services.rollout.engines.sampling import keep_likeliest, penalise_repeats, sample_token
from tests import factories


def test_top_k_1_is_greedy():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    for seed in range(20):
        token, logprob = sample_token(logits, SamplingParams(top_k=1), seed, 0)
        assert token == int(logits.argmax()) and logprob == 0.0  # all the mass on one token


def test_top_k_draws_among_the_k_likeliest_with_renormalised_logprobs():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    draws = {sample_token(logits, SamplingParams(top_k=2), s, 0) for s in range(60)}
    assert {t for t, _ in draws} == {0, 1}
    kept = torch.log_softmax(logits[:2], -1)
    for token, logprob in draws:
        assert logprob == pytest.approx(kept[token].item(), abs=1e-6)


def test_top_k_and_top_p_keep_what_transformers_keeps():
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(40, generator=gen) * 3
        for top_k, top_p in ((5, 1.0), (0, 0.7), (8, 0.5)):
            scores = logits.unsqueeze(0)
            if top_k:
                scores = TopKLogitsWarper(top_k)(None, scores)
            if top_p < 1.0:
                scores = TopPLogitsWarper(top_p)(None, scores)
            theirs = torch.log_softmax(scores[0], -1)
            ours = keep_likeliest(torch.log_softmax(logits, -1), top_k, top_p)
            assert torch.equal(ours.isfinite(), theirs.isfinite())
            assert torch.allclose(ours[ours.isfinite()], theirs[theirs.isfinite()], atol=1e-5)


def test_repetition_penalty_is_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(30, generator=torch.Generator().manual_seed(2))
    context = [3, 7, 7, 12, 29]
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([context]), logits.unsqueeze(0))
    assert torch.allclose(penalise_repeats(logits, context, 1.3), theirs[0])
    assert torch.equal(penalise_repeats(logits, context, 1.0), logits)


def test_repetition_penalty_lowers_a_seen_tokens_probability():
    logits = torch.tensor([2.0, 1.5, -0.5, 0.0])
    seen = [0, 2]  # one positive logit, one negative
    for token in seen:
        plain = torch.log_softmax(logits, -1)[token]
        penalised = torch.log_softmax(penalise_repeats(logits, seen, 2.0), -1)[token]
        assert penalised < plain
    # the draw's logprob is under the penalised distribution
    penalised = SamplingParams(repetition_penalty=2.0)
    token, logprob = sample_token(logits, penalised, 0, 0, context=seen)
    expected = torch.log_softmax(penalise_repeats(logits, seen, 2.0), -1)[token]
    assert logprob == pytest.approx(expected.item())
    # greedy follows the penalised logits: token 0 is no longer the likeliest
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample_token(logits, greedy, 0, 0, context=seen)[0] == 1


def test_the_request_table_puts_the_knobs_in_every_job():
    sampling = SamplingParams(max_new_tokens=4, top_p=0.9, top_k=20, repetition_penalty=1.1)
    table = factories.table(1, 2, run_id="r", stops=(), sampling=sampling)
    for job in table.initial_jobs():
        assert job.sampling == sampling
        assert Job.decode(job.encode()) == job


def encoded_job(**sampling) -> bytes:
    """A job as a coordinator encodes it, with `sampling` as the only sampling fields."""
    base = {
        "run_id": "r",
        "request_id": "0:0:0",
        "lease": 0,
        "grant": "g",
        "version": 0,
        "prompt_ids": [1],
        "remaining_tokens": 2,
        "sampling": sampling,
        "seed": 3,
    }
    return msgspec.msgpack.encode(base)


def test_knobs_left_out_of_a_job_decode_off():
    job = Job.decode(encoded_job(temperature=0.5))
    assert job.sampling == SamplingParams(temperature=0.5)
    assert (job.sampling.top_k, job.sampling.repetition_penalty) == (0, 1.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"top_k": -1},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": math.nan},
        {"temperature": 11.0},
        {"top_p": 0.0},
        {"max_new_tokens": 0},
    ],
)
def test_job_knobs_are_bounded(bad):
    with pytest.raises(MalformedMessage):
        Job.decode(encoded_job(**bad))


def mixed_draws(n: int):
    """Draws of every kind: temperatures 1, 0.7 and 0 (greedy), top-p, and every fifth with
    top-k and a repetition penalty (drawn row by row)."""
    from services.rollout.engines.sampling import Draw

    filtered = SamplingParams(top_k=5, repetition_penalty=1.3)
    return [
        Draw(
            SamplingParams(temperature=[1.0, 0.7, 0.0][i % 3], top_p=1.0 if i % 4 else 0.9),
            seed=i,
            position=i,
        )
        if i % 5
        else Draw(filtered, i, i, context=[1, 2, 3])
        for i in range(n)
    ]


def test_a_row_draws_the_same_token_alone_and_in_any_batch():
    """A continuation on another worker runs beside other requests: its draw must not depend
    on them. Plain rows (drawn as one batch) and filtered ones (drawn one by one) alike."""
    from services.rollout.engines.sampling import sample_rows

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 40, generator=gen) * 3
    draws = mixed_draws(12)
    together = sample_rows(logits, draws)
    alone = [sample_rows(logits[i : i + 1], [d])[0] for i, d in enumerate(draws)]
    reversed_batch = sample_rows(logits.flip(0), draws[::-1])[::-1]
    assert together == alone == reversed_batch
    for (token, logprob), d, row in zip(together, draws, logits, strict=True):
        if d.sampling.temperature == 0:
            assert token == int(row.argmax())
        assert math.isfinite(logprob) and logprob <= 0.0


def test_draws_follow_the_distribution():
    """The inverse-CDF draw over (seed, position) hashes samples the softmax: token
    frequencies over many seeds match the probabilities."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    counts = torch.zeros(4)
    for seed in range(4000):
        token, logprob = sample_token(logits, SamplingParams(), seed, 0)
        counts[token] += 1
        assert logprob == pytest.approx(math.log(probs[token].item()), abs=1e-5)
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_row_draws_on_cuda_what_it_draws_on_the_cpu():
    """A continuation may land on a worker with another device: the same (seed, position)
    draws the same token from the same logits on CUDA as on the CPU, a batch at once."""
    from services.rollout.engines.sampling import sample_rows

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 1000, generator=gen) * 3
    draws = mixed_draws(64)
    cpu = sample_rows(logits, draws)
    cuda = sample_rows(logits.to("cuda"), draws)
    assert [t for t, _ in cuda] == [t for t, _ in cpu]
    for (_, a), (_, b) in zip(cuda, cpu, strict=True):
        assert a == pytest.approx(b, abs=1e-4)

"""The trainer's micro-batches (issue 20): cut by tokens, packed without padding, log-probs from
the LM head at response positions only and in chunks, activation checkpointing and bfloat16
autocast, each against the padded full-logits path on the tiny model (fp32, CPU)."""

import random

import pytest
import torch

from services.contracts.runspec import RunSpec
from services.trainer.batching import Row, cut_by_count, cut_by_tokens, packed, padded
from services.trainer.grpo import StepSize, response_logprobs, token_logprobs
from services.trainer.policy import Policy
from services.trainer.stats import PassStats


def rows_of(lengths: list[tuple[int, int]], seed: int = 0) -> list[Row]:
    """Rows with prompts and responses of the given lengths; a group's rows share a prompt."""
    rng = random.Random(seed)
    out = []
    for p_len, r_len in lengths:
        prompt = [rng.randrange(5, 40) for _ in range(p_len)]
        response = [rng.randrange(5, 40) for _ in range(r_len)]
        out.append(Row(prompt, response, [-rng.random() for _ in response], rng.gauss(0, 1)))
    return out


def test_cut_by_tokens_keeps_each_micro_batch_within_the_budget():
    rows = rows_of([(3, 2), (3, 4), (2, 1), (10, 5), (1, 1), (2, 2)])  # 5, 7, 3, 15, 2, 4
    batches, rest = cut_by_tokens(rows, budget=12, final=False)
    assert [[r.tokens for r in b] for b in batches] == [[5, 7], [3], [15]]
    assert [r.tokens for r in rest] == [2, 4]  # waits for more rows
    batches, rest = cut_by_tokens(rows, budget=12, final=True)
    assert [[r.tokens for r in b] for b in batches][-1] == [2, 4] and rest == []
    batches, rest = cut_by_count(rows, size=4, final=False)
    assert [len(b) for b in batches] == [4] and len(rest) == 2


def test_layouts_place_each_response_token_where_its_predicting_state_is():
    rows = rows_of([(3, 2), (2, 4)])
    pad, pack = padded(rows, pad_id=0), packed(rows)
    assert pad.input_ids.shape == (2, 6) and pad.padding_tokens == 1
    assert pack.input_ids.shape == (1, 11) and pack.padding_tokens == 0
    assert pack.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]]
    for batch in (pad, pack):
        flat = batch.input_ids.reshape(-1)
        # the token after each predicting position is the response token itself
        got = flat[batch.positions + 1] * batch.mask.long()
        assert torch.equal(got, batch.targets * batch.mask.long())
        assert batch.mask.sum() == 6


def test_chunked_logprobs_equal_full_logprobs_and_their_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    head = torch.randn(50, 16, requires_grad=True)
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.zeros(2, 6)
    mask[0, 2:6], mask[1, 3:5] = 1, 1
    full = token_logprobs(hidden @ head.T, ids, temperature=0.7) * mask
    (g_full,) = torch.autograd.grad(full.sum(), [hidden], retain_graph=True)
    (h_full,) = torch.autograd.grad(full.sum(), [head])
    # the same tokens as a [N, T] response table
    positions = torch.tensor([[2, 3, 4, 5], [10, 11, 0, 0]])
    targets = torch.tensor(
        [[ids[0, 3], ids[0, 4], ids[0, 5], ids[0, 6]], [ids[1, 4], ids[1, 5], 0, 0]]
    )
    table_mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    for chunk in (1, 3, 100):
        got = response_logprobs(
            hidden.reshape(-1, 16), head, None, positions, targets, table_mask, 0.7, chunk
        )
        want = torch.stack([full[0, 2:6], torch.cat([full[1, 3:5], torch.zeros(2)])])
        assert torch.allclose(got, want, atol=1e-6)
        g, h = torch.autograd.grad(got.sum(), [hidden, head])
        assert torch.allclose(g, g_full, atol=1e-5) and torch.allclose(h, h_full, atol=1e-5)


def spec_for(tiny_model, **over) -> RunSpec:
    base = {"model": str(tiny_model), "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6}
    return RunSpec(**(base | {"micro_batch_size": 8, "max_grad_norm": 0.0} | over))


def gradient(policy: Policy, rows: list[Row]) -> tuple[float, list[torch.Tensor]]:
    """The loss and gradient of one backward pass over `rows`."""
    policy.optimizer.zero_grad(set_to_none=True)
    stats = PassStats()
    size = StepSize(len(rows), 6, float(sum(len(r.response_ids) for r in rows)))
    policy._backward(rows, size, 1.0, stats)
    return stats.policy_loss, [p.grad.clone() for p in policy.model.parameters()]


@pytest.fixture(scope="module")
def long_tailed_rows():
    # eight responses of 1 to 6 tokens, to prompts of 5 and 3 tokens
    return rows_of([(5, n) for n in (1, 6, 2, 3)] + [(3, n) for n in (4, 1, 5, 6)], seed=2)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_packed_equals_padded_loss_and_gradients(tiny_model, long_tailed_rows, loss_type):
    padded_policy = Policy(tiny_model, spec_for(tiny_model, loss_type=loss_type))
    packed_policy = Policy(
        tiny_model, spec_for(tiny_model, loss_type=loss_type, max_tokens_per_micro_batch=1000)
    )
    loss_a, grads_a = gradient(padded_policy, long_tailed_rows)
    loss_b, grads_b = gradient(packed_policy, long_tailed_rows)
    assert loss_a == pytest.approx(loss_b, abs=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_chunked_and_checkpointed_passes_give_the_same_gradient(tiny_model, long_tailed_rows):
    _, base = gradient(Policy(tiny_model, spec_for(tiny_model)), long_tailed_rows)
    for over in ({"logprob_chunk_tokens": 3}, {"gradient_checkpointing": True}):
        _, grads = gradient(Policy(tiny_model, spec_for(tiny_model, **over)), long_tailed_rows)
        for a, b in zip(base, grads, strict=True):
            assert torch.allclose(a, b, atol=1e-5), over


def test_bfloat16_autocast_stays_near_float32(tiny_model, long_tailed_rows):
    """bfloat16 has 8 bits of mantissa: the loss within 2% and the gradient's direction within
    a few degrees of float32's, on weights kept in float32."""
    loss32, g32 = gradient(Policy(tiny_model, spec_for(tiny_model)), long_tailed_rows)
    bf16 = Policy(tiny_model, spec_for(tiny_model, train_precision="bfloat16"))
    loss16, g16 = gradient(bf16, long_tailed_rows)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert loss16 == pytest.approx(loss32, rel=0.02, abs=1e-3)
    a, b = torch.cat([g.flatten() for g in g32]), torch.cat([g.flatten() for g in g16])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99


def test_stale_tokens_come_from_the_version_runs():
    from services.trainer.batching import stale_tokens

    assert stale_tokens([], 4, version=3) is None  # runs not recorded: nothing is stale
    assert stale_tokens([(0, 3)], 4, version=3) is None  # a synchronous step
    assert stale_tokens([(0, 2), (2, 3), (3, 1)], 5, version=3) == [1, 1, 0, 1, 1]


def test_stale_rows_take_the_decoupled_loss_fresh_rows_the_synchronous_one(
    tiny_model, long_tailed_rows
):
    import dataclasses

    policy = Policy(tiny_model, spec_for(tiny_model))
    _, base = gradient(policy, long_tailed_rows)
    fresh = [dataclasses.replace(r, stale=[False] * len(r.response_ids)) for r in long_tailed_rows]
    _, same = gradient(policy, fresh)
    assert all(torch.equal(a, b) for a, b in zip(base, same, strict=True))
    stale = [dataclasses.replace(r, stale=[True] * len(r.response_ids)) for r in long_tailed_rows]
    for layout in ({}, {"max_tokens_per_micro_batch": 1000}):
        _, moved = gradient(Policy(tiny_model, spec_for(tiny_model, **layout)), stale)
        assert any(not torch.allclose(a, b) for a, b in zip(base, moved, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("over", [{}, {"max_tokens_per_micro_batch": 1000}])
def test_compiled_layers_give_the_eager_loss_and_gradient(tiny_model, long_tailed_rows, over):
    """torch_compile: each decoder layer compiled (inductor; padded and packed micro-batches of
    new shapes) gives eager's loss and gradient, and the layers are compiled ones."""
    loss_a, grads_a = gradient(Policy(tiny_model, spec_for(tiny_model, **over)), long_tailed_rows)
    compiled = Policy(tiny_model, spec_for(tiny_model, torch_compile=True, **over))
    for rows in (long_tailed_rows[:4], long_tailed_rows):  # a second shape: a recompile
        loss_b, grads_b = gradient(compiled, rows)
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.model.layers)
    assert loss_a == pytest.approx(loss_b, abs=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()

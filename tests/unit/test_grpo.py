import pytest
import torch

from services.trainer.grpo import StepSize, group_advantages, grpo_loss, token_logprobs


def size(sequences: int) -> StepSize:
    return StepSize(sequences, max_new_tokens=4, tokens=0)


def test_group_advantages_are_normalised():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    # sample std (n - 1) of the group, plus 1e-4
    expected = 0.5 / ((1 / 3) ** 0.5 + 1e-4)
    assert adv == pytest.approx([expected, -expected, -expected, expected], abs=1e-9)
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.5]) == [0.0]


def test_loss_gradient_raises_logprob_of_positive_advantage():
    logits = torch.zeros(2, 3, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :1].expand(2, 1)  # logprob of token 0
    old = logp.detach()
    parts = grpo_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1), size(2))
    parts.loss.backward()
    # descending the loss raises token 0's logit for the positive sample, lowers it otherwise
    assert logits.grad[0, 0] < 0 < logits.grad[1, 0]


def test_ratio_is_clipped():
    logp = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-1.0]])  # ratio e > 1 + clip
    parts = grpo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), size(1), epsilon=0.2)
    parts.loss.backward()
    assert logp.grad.abs().item() == 0.0
    assert parts.clip_fraction == 1.0


def test_kl_is_zero_at_reference_and_positive_away():
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    same = grpo_loss(logp, logp, torch.zeros(1), mask, size(1), ref_logprobs=logp.clone(), beta=0.1)
    assert same.kl == pytest.approx(0.0)
    away = grpo_loss(logp, logp, torch.zeros(1), mask, size(1), ref_logprobs=logp - 0.5, beta=0.1)
    assert away.kl > 0


def test_masked_tokens_do_not_count():
    logp = torch.tensor([[-1.0, -5.0]], requires_grad=True)
    parts = grpo_loss(logp, logp.detach(), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), size(1))
    parts.loss.backward()
    assert logp.grad[0, 1] == 0 and parts.tokens == 1


def test_token_logprobs_align_with_next_tokens():
    logits = torch.randn(1, 4, 7)
    ids = torch.tensor([[1, 2, 3, 4]])
    out = token_logprobs(logits, ids, temperature=1.0)
    expected = torch.log_softmax(logits[0, 1], -1)[3]
    assert out.shape == (1, 3) and out[0, 1] == pytest.approx(expected.item())


def _loss_and_grad(logp0, old, adv, mask, **kw):
    logp = logp0.clone().requires_grad_(True)
    size = StepSize(sequences=logp.shape[0], max_new_tokens=logp.shape[1], tokens=mask.sum())
    parts = grpo_loss(logp, old, adv, mask, size, **kw)
    parts.loss.backward()
    return parts, logp.grad


def test_no_stale_token_is_the_synchronous_loss_bit_for_bit():
    torch.manual_seed(0)
    logp, old = -torch.rand(3, 5), -torch.rand(3, 5)
    adv, mask = torch.randn(3), torch.ones(3, 5)
    sync, g_sync = _loss_and_grad(logp, old, adv, mask)
    fresh, g_fresh = _loss_and_grad(logp, old, adv, mask, stale=torch.zeros(3, 5, dtype=torch.bool))
    assert torch.equal(sync.loss, fresh.loss) and torch.equal(g_sync, g_fresh)
    assert sync.clip_fraction == fresh.clip_fraction


def test_a_stale_token_is_weighted_by_its_truncated_behaviour_ratio_and_never_clipped():
    # one response of 3 tokens: the first sampled by the current weights, the other two by older
    # ones that found them 1.5x and 10x less likely than the current weights do
    logp = torch.log(torch.tensor([[0.5, 0.6, 0.4]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.4, 0.04]]))
    stale = torch.tensor([[False, True, True]])
    adv, mask = torch.tensor([2.0]), torch.ones(1, 3)
    parts, grad = _loss_and_grad(logp, behaviour, adv, mask, stale=stale, behaviour_cap=2.0)
    # grpo: d loss / d logp_t = -w_t x A / (tokens x responses); r = 1 on every token
    expected = -torch.tensor([[1.0, 1.5, 2.0]]) * 2.0 / 3
    assert torch.allclose(grad, expected, atol=1e-6)
    assert parts.clip_fraction == 0.0  # the 10x behaviour ratio is weighted, not clipped
    # without the correction the same tokens would be clipped away (r = 10 > 1.2)
    plain, plain_grad = _loss_and_grad(logp, behaviour, adv, mask)
    assert plain_grad[0, 2] == 0.0 and plain.clip_fraction > 0

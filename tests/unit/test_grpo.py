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

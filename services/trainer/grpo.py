"""GRPO, as pure tensor functions: group-normalised advantages and the token-level clipped
policy objective with an optional KL penalty to the initial policy (the low-variance "k3"
estimator). No model, no I/O: the trainer loop feeds them tensors.

Loss aggregation is "sequence mean of token means" divided by a constant number of sequences
per step, so that micro-batches can be backpropagated as their groups arrive and the summed
gradient equals that of one big batch.
"""

from dataclasses import dataclass

import torch


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) within one group; all zeros when every reward is equal."""
    t = torch.tensor(rewards, dtype=torch.float64)
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    std = t.std(unbiased=False)
    if std < eps:
        return [0.0] * len(rewards)
    return ((t - t.mean()) / (std + eps)).tolist()


@dataclass
class LossParts:
    loss: torch.Tensor  # scalar to backpropagate
    policy: float
    kl: float
    clip_fraction: float
    tokens: int


def grpo_loss(
    logprobs: torch.Tensor,  # [N, T] log pi_theta(token) for response tokens
    old_logprobs: torch.Tensor,  # [N, T] log pi_old(token), from rollout
    advantages: torch.Tensor,  # [N]
    mask: torch.Tensor,  # [N, T] 1 on response tokens
    clip_range: float,
    sequences_per_step: int,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossParts:
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl_tokens = torch.zeros_like(per_token)
    if ref_logprobs is not None and kl_coef > 0:
        log_ratio = ref_logprobs - logprobs
        kl_tokens = torch.exp(log_ratio) - log_ratio - 1.0
        per_token = per_token + kl_coef * kl_tokens
    lengths = mask.sum(dim=1).clamp(min=1.0)
    per_sequence = (per_token * mask).sum(dim=1) / lengths
    loss = per_sequence.sum() / sequences_per_step
    with torch.no_grad():
        n_tokens = int(mask.sum().item())
        clip_frac = (((unclipped - clipped).abs() > 1e-9).to(mask.dtype) * mask).sum() / max(
            1, n_tokens
        )
        policy = ((-torch.minimum(unclipped, clipped) * mask).sum(1) / lengths).mean()
        kl = ((kl_tokens * mask).sum(1) / lengths).mean()
    return LossParts(loss, float(policy), float(kl), float(clip_frac), n_tokens)


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log p(input_ids[:, t+1] | prefix) for t in [0, T-1): shape [N, T-1]."""
    scaled = logits[:, :-1].float()
    if temperature > 0:
        scaled = scaled / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)

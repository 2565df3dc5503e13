"""GRPO as pure tensor functions, with the names and formulas of TRL's GRPOTrainer (docs/trl.md):
advantages (`scale_rewards`), the token-level clipped objective (`epsilon`, `epsilon_high`) with
an optional penalty to the reference policy (`beta`, the "k3" KL estimator), and the token-loss
aggregations (`loss_type`). No model, no I/O: the policy feeds them tensors.

Every token sum, mean and count here is over the `mask`: the tokens the model generated. A
multi-turn response's observation tokens are out of it, so they weigh in no loss, KL, clip
fraction or size, whatever the loss_type.

Every aggregation is written as one micro-batch's share of the step's loss, so that the step's
loss is the sum of its micro-batches' shares: the trainer backpropagates micro-batches as their
groups arrive and the summed gradient is that of the whole step. What a share divides by comes
from `StepSize`; the policy module says when its `tokens` is only known at the end of the step.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

ScaleRewards = Literal["group", "batch", "none"]
LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
STD_EPS = 1e-4  # added to the std before dividing by it (TRL's)


def sample_std(values: Sequence[float]) -> float:
    """Standard deviation with Bessel's correction (divided by n - 1, as TRL's); 0 for fewer
    than two values."""
    if len(values) < 2:
        return 0.0
    return float(torch.tensor(values, dtype=torch.float64).std(unbiased=True))


def group_advantages(
    rewards: Sequence[float], scale_rewards: ScaleRewards = "group"
) -> list[float]:
    """Each reward minus its group's mean, divided by (the group's sample std + 1e-4) under
    "group". Under "batch" the division by the step's std is left to `batch_scale`; "none"
    leaves the centred rewards as they are. A group of equal rewards has zero advantages."""
    t = torch.tensor(rewards, dtype=torch.float64)
    centred = t - t.mean() if len(rewards) else t
    if scale_rewards == "group":
        centred = centred / (sample_std(rewards) + STD_EPS)
    return centred.tolist()


def batch_scale(rewards: Sequence[float]) -> float:
    """What "batch" multiplies the centred rewards by: 1 / (the sample std of all the step's
    rewards + 1e-4)."""
    return 1.0 / (sample_std(rewards) + STD_EPS)


def step_advantages(
    groups: Sequence[Sequence[float]], scale_rewards: ScaleRewards
) -> list[list[float]]:
    """The advantages of a whole step's groups of rewards at once."""
    out = [group_advantages(g, scale_rewards) for g in groups]
    if scale_rewards == "batch":
        scale = batch_scale([r for g in groups for r in g])
        out = [[a * scale for a in g] for g in out]
    return out


@dataclass(frozen=True)
class StepSize:
    """The step-wide sizes the aggregations divide by."""

    sequences: int  # responses the step trains on: prompts_per_step x group_size
    max_new_tokens: int  # the response budget (dr_grpo's constant)
    tokens: float  # generated response tokens in the step (dapo): observations not counted


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: LossType,
    size: StepSize,
    whole: tuple[int, int] | None = None,
) -> torch.Tensor:
    """One micro-batch's share of the step's loss, from its [N, T] token losses.

    grpo: each response's token mean, averaged over the step's responses. bnpo: the
    micro-batch's token mean, weighted by its share of the step's responses (TRL: the local
    batch's token mean over the accumulation steps; it depends on the micro-batch size).
    dr_grpo: the step's token sum over responses x max_new_tokens. dapo: the step's token sum
    over the step's token count.

    `whole`: (responses, tokens) of the micro-batch when these rows are only a part of it (a
    rank's share): every aggregation but bnpo is a sum over responses, and bnpo's share of a part
    divides by the whole micro-batch's sizes, so the parts' shares add up to the whole's."""
    masked = per_token * mask
    if loss_type == "grpo":
        lengths = mask.sum(dim=1).clamp(min=1.0)
        return (masked.sum(dim=1) / lengths).sum() / size.sequences
    if loss_type == "bnpo":
        rows, tokens = whole or (per_token.shape[0], mask.sum().item())
        return (rows / size.sequences) * masked.sum() / max(tokens, 1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (size.sequences * size.max_new_tokens)
    if loss_type == "dapo":
        return masked.sum() / max(size.tokens, 1.0)
    raise ValueError(f"unknown loss_type {loss_type!r}")


@dataclass
class LossParts:
    loss: torch.Tensor  # the micro-batch's share of the step's loss, to backpropagate
    policy: float  # mean over responses of each one's token-mean policy loss
    kl: float  # the same mean of the k3 KL to the reference (0 without one)
    clip_fraction: float  # share of tokens whose clipped term was taken
    tokens: int  # tokens in the mask: generated response tokens


def grpo_loss(
    logprobs: torch.Tensor,  # [N, T] log pi_theta(token) for response tokens
    old_logprobs: torch.Tensor,  # [N, T] log pi_old(token): the rollout's sampling logprobs
    advantages: torch.Tensor,  # [N]
    mask: torch.Tensor,  # [N, T] 1 on generated response tokens (0: observation or padding)
    size: StepSize,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,  # None: epsilon
    loss_type: LossType = "grpo",
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    whole: tuple[int, int] | None = None,  # the micro-batch's sizes, these rows a part of it
    stale: torch.Tensor | None = None,  # [N, T] True where an older version made the token
    behaviour_cap: float = 2.0,
) -> LossParts:
    """Token loss -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) with r the ratio to the
    old policy, plus beta x k3 KL to the reference, aggregated by `loss_type`.

    `stale` tokens (sampled by weights older than those the step trains from: asynchronous
    rollout) take decoupled PPO's objective (Hilton et al. 2021, "Batch size-invariance for
    policy optimization"; AReaL, Fu et al. 2025): their ratio r is to the proximal policy, the
    weights this step trains from (in value the current ones: the pass is the step's first),
    and the behaviour policy that sampled them enters only as an importance weight
    pi_prox / pi_behaviour, detached and truncated at `behaviour_cap`, so that a token the old
    weights found unlikely cannot dominate the step. Every other token is as before: with no
    stale token the loss is the synchronous one, bit for bit."""
    high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logprobs.dtype)
    old, weight = old_logprobs, None
    if stale is not None:
        prox = logprobs.detach()
        old = torch.where(stale, prox, old_logprobs)
        behaviour = torch.exp(prox - old_logprobs).clamp(max=behaviour_cap)
        weight = torch.where(stale, behaviour, torch.ones_like(prox))
    ratio = torch.exp(logprobs - old)
    adv = advantages.unsqueeze(1)
    policy_tokens = -torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - epsilon, 1.0 + high) * adv)
    if weight is not None:
        policy_tokens = policy_tokens * weight
    per_token = policy_tokens
    kl_tokens = torch.zeros_like(per_token)
    if ref_logprobs is not None and beta > 0:
        log_ratio = ref_logprobs - logprobs
        kl_tokens = torch.exp(log_ratio) - log_ratio - 1.0
        per_token = per_token + beta * kl_tokens
    loss = aggregate(per_token, mask, loss_type, size, whole)
    with torch.no_grad():
        n_tokens = int(mask.sum().item())
        lengths = mask.sum(dim=1).clamp(min=1.0)
        clipped = ((ratio < 1.0 - epsilon) & (adv < 0)) | ((ratio > 1.0 + high) & (adv > 0))
        clip_frac = (clipped.to(mask.dtype) * mask).sum() / max(1, n_tokens)
        policy = ((policy_tokens * mask).sum(1) / lengths).mean()
        kl = ((kl_tokens * mask).sum(1) / lengths).mean()
    return LossParts(loss, float(policy), float(kl), float(clip_frac), n_tokens)


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log p(input_ids[:, t+1] | prefix) for t in [0, T-1): shape [N, T-1]. The logits are
    divided by the temperature and nothing else (no top-k, top-p or repetition penalty), as
    TRL computes its training logprobs."""
    scaled = logits[:, :-1].float()
    if temperature > 0:
        scaled = scaled / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def response_logprobs(
    hidden: torch.Tensor,  # [M, H] the model's last hidden states, flattened
    head_weight: torch.Tensor,  # [V, H] the LM head
    head_bias: torch.Tensor | None,
    positions: torch.Tensor,  # [N, T] where in `hidden` the state predicting each token sits
    targets: torch.Tensor,  # [N, T] the tokens
    mask: torch.Tensor,  # [N, T] 1 where there is a token
    temperature: float,
    chunk_tokens: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """log p(targets) from the hidden states at `positions`, [N, T] (0 where `mask` is 0), as
    `token_logprobs` computes them from full logits: the LM head runs at the response's
    positions only, and `chunk_tokens` of them at a time, each chunk's logits recomputed in the
    backward pass instead of kept, so that no [tokens x vocab] tensor of the whole micro-batch
    is ever held (`softcap`: the model's final logit soft-capping, where it has one)."""
    where = mask.bool()
    states = hidden[positions[where]]
    wanted = targets[where]

    def chunk_logprobs(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(h, head_weight, head_bias).float()
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        if temperature > 0:
            logits = logits / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)

    if states.shape[0] <= chunk_tokens:
        picked = chunk_logprobs(states, wanted)
    else:
        from torch.utils.checkpoint import checkpoint

        picked = torch.cat(
            [
                checkpoint(chunk_logprobs, h, t, use_reentrant=False)
                for h, t in zip(states.split(chunk_tokens), wanted.split(chunk_tokens), strict=True)
            ]
        )
    out = torch.zeros(mask.shape, dtype=picked.dtype, device=picked.device)
    return out.masked_scatter(where, picked)

"""TRL's GRPO knobs as pure functions: each changes what it should, with TRL's formulas
(advantages and their scaling, the loss aggregations, the asymmetric clip, the KL term, the
learning-rate schedules)."""

import math

import pytest
import torch

from services.contracts.runspec import RunSpec
from services.trainer.grpo import (
    StepSize,
    aggregate,
    batch_scale,
    group_advantages,
    grpo_loss,
    step_advantages,
)
from services.trainer.optim import build_optimizer, build_scheduler, lr_multiplier

# two groups of a step: a split one (mean 0.5) and a solved one
GROUPS = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def flat(groups):
    return [a for g in groups for a in g]


def test_scale_rewards_none_leaves_the_centred_rewards():
    assert step_advantages(GROUPS, "none") == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4]


def test_scale_rewards_group_divides_by_the_groups_sample_std():
    std = math.sqrt((4 * 0.25) / 3)  # n - 1
    a = 0.5 / (std + 1e-4)
    assert flat(step_advantages(GROUPS, "group")) == pytest.approx([a, -a, -a, a] + [0.0] * 4)


def test_scale_rewards_batch_divides_by_the_steps_sample_std():
    # the eight rewards: six 1s and two 0s, mean 0.75
    std = math.sqrt((6 * 0.25**2 + 2 * 0.75**2) / 7)
    a = 0.5 / (std + 1e-4)
    assert flat(step_advantages(GROUPS, "batch")) == pytest.approx([a, -a, -a, a] + [0.0] * 4)
    assert batch_scale(flat(GROUPS)) == pytest.approx(1 / (std + 1e-4))
    # the group mean is still the baseline: only the divisor is the batch's
    assert group_advantages(GROUPS[0], "batch") == [0.5, -0.5, -0.5, 0.5]


# a hand batch: token losses of two responses (3 tokens and 1 token) in one micro-batch
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        ("grpo", (6 / 3 + 4 / 1) / 4),  # response means, over the step's 4 responses
        ("bnpo", (2 / 4) * (10 / 4)),  # the micro-batch's token mean, times its share
        ("dr_grpo", 10 / (4 * 5)),  # token sum / (responses x max_new_tokens)
        ("dapo", 10 / 7),  # token sum / the step's 7 tokens
    ],
)
def test_each_loss_type_aggregates_by_its_formula(loss_type, expected):
    size = StepSize(sequences=4, max_new_tokens=5, tokens=7)
    assert aggregate(PER_TOKEN, MASK, loss_type, size).item() == pytest.approx(expected)


def split_and_whole(loss_type):
    torch.manual_seed(0)
    per_token = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1.0
    size = StepSize(sequences=6, max_new_tokens=5, tokens=float(mask.sum()))
    parts = [aggregate(per_token[i : i + 2], mask[i : i + 2], loss_type, size) for i in (0, 2, 4)]
    return sum(parts).item(), aggregate(per_token, mask, loss_type, size).item()


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_sum_to_the_whole_steps_loss(loss_type):
    split, whole = split_and_whole(loss_type)
    assert split == pytest.approx(whole, rel=1e-6)


def test_bnpo_depends_on_the_micro_batch_and_is_grpo_at_one_response():
    split, whole = split_and_whole("bnpo")
    assert split != pytest.approx(whole, rel=1e-6)  # as TRL's: the local batch's token mean
    per_token, mask = PER_TOKEN, MASK
    size = StepSize(sequences=2, max_new_tokens=5, tokens=4)
    ones = [aggregate(per_token[i : i + 1], mask[i : i + 1], "bnpo", size) for i in (0, 1)]
    assert sum(ones).item() == pytest.approx(aggregate(per_token, mask, "grpo", size).item())


def clipped_gradient(ratio, advantage, **clip):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    size = StepSize(1, 1, 1)
    parts = grpo_loss(
        logp, torch.zeros(1, 1), torch.tensor([advantage]), torch.ones(1, 1), size, **clip
    )
    parts.loss.backward()
    return logp.grad.item(), parts.clip_fraction


def test_epsilon_high_clips_only_the_upper_side():
    # ratio 1.25 with a positive advantage: past 1 + 0.2, within 1 + 0.28
    assert clipped_gradient(1.25, 1.0, epsilon=0.2) == (0.0, 1.0)
    grad, clipped = clipped_gradient(1.25, 1.0, epsilon=0.2, epsilon_high=0.28)
    assert grad == pytest.approx(-1.25) and clipped == 0.0
    # the lower side stays at 1 - epsilon: ratio 0.75 with a negative advantage is clipped
    assert clipped_gradient(0.75, -1.0, epsilon=0.2, epsilon_high=0.28) == (0.0, 1.0)
    assert clipped_gradient(0.85, -1.0, epsilon=0.2, epsilon_high=0.28)[1] == 0.0


def test_beta_adds_the_k3_kl_to_the_reference():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = logp - 0.5
    size = StepSize(1, 2, 2)
    base = grpo_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), size, ref_logprobs=ref)
    with_kl = grpo_loss(
        logp, logp, torch.zeros(1), torch.ones(1, 2), size, ref_logprobs=ref, beta=0.1
    )
    k3 = math.exp(-0.5) + 0.5 - 1.0  # exp(ref - logp) - (ref - logp) - 1, per token
    assert base.loss.item() == 0.0 and with_kl.kl == pytest.approx(k3)
    assert with_kl.loss.item() == pytest.approx(0.1 * k3)


@pytest.mark.parametrize("kind", ["constant_with_warmup", "linear", "cosine"])
def test_lr_schedules_match_transformers(kind):
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    theirs = get_scheduler(kind, optimizer, num_warmup_steps=4, num_training_steps=20)
    for step in range(22):
        assert lr_multiplier(step, kind, 4, 20) == pytest.approx(theirs.get_last_lr()[0]), step
        optimizer.step()
        theirs.step()


def test_lr_schedule_values_at_warmup_middle_and_end():
    assert [lr_multiplier(s, "linear", 4, 24) for s in (0, 2, 4, 14, 24)] == [0, 0.5, 1, 0.5, 0]
    assert lr_multiplier(14, "cosine", 4, 24) == pytest.approx(0.5)
    assert lr_multiplier(9, "constant", 0, 10) == 1.0


def run_schedule(spec, steps, state=None):
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, spec)
    scheduler = build_scheduler(optimizer, spec)
    if state is not None:
        optimizer.load_state_dict(state[0])
        scheduler.load_state_dict(state[1])
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        model(torch.ones(2)).sum().backward()
        optimizer.step()
        scheduler.step()
    return lrs, (optimizer.state_dict(), scheduler.state_dict())


def test_the_schedule_counts_optimizer_steps_and_resumes():
    spec = RunSpec(
        model="/m", steps=5, num_iterations=2, lr_scheduler_type="linear", warmup_steps=2
    )
    full, _ = run_schedule(spec, 10)
    # 5 RL steps x 2 iterations: warmup over 2 optimizer steps, then down to 0 at the 10th
    assert full == pytest.approx([lr_multiplier(s, "linear", 2, 10) * 1e-4 for s in range(10)])
    head, state = run_schedule(spec, 4)
    tail, _ = run_schedule(spec, 6, state)
    assert head + tail == pytest.approx(full)


def test_constant_takes_no_warmup():
    with pytest.raises(ValueError, match="constant_with_warmup"):
        RunSpec(model="/m", warmup_steps=3)
    assert RunSpec(model="/m", lr_scheduler_type="constant_with_warmup", warmup_steps=3)


def test_scale_rewards_takes_trls_booleans():
    assert RunSpec(model="/m", scale_rewards=True).loss.scale_rewards == "group"
    assert RunSpec(model="/m", scale_rewards=False).loss.scale_rewards == "none"
    assert RunSpec.model_validate_json(
        '{"model": "/m", "scale_rewards": false}'
    ).loss.scale_rewards == ("none")
    with pytest.raises(ValueError):
        RunSpec(model="/m", scale_rewards="std")

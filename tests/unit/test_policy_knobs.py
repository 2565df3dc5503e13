"""The policy with TRL's knobs, on the tiny model: the pipelined gradient is the whole step's (each
loss_type and scale_rewards, the KL term included), num_iterations takes more optimizer steps off
the rollout policy, the optimizer and schedule settings reach torch, and the schedule resumes."""

import random

import msgspec
import pytest
import torch

from services.contracts.messages import Group, Response
from services.contracts.runspec import RunSpec
from services.trainer.grpo import StepSize, grpo_loss, step_advantages, token_logprobs
from services.trainer.policy import Policy

PROMPTS, RESPONSES, BUDGET = 3, 4, 4


def knobs(tiny_model, **over) -> RunSpec:
    base = {
        "model": str(tiny_model),
        "prompts_per_step": PROMPTS,
        "group_size": RESPONSES,
        "max_new_tokens": BUDGET,
        "micro_batch_size": 3,
        "max_grad_norm": 0.0,  # the hooks below see the gradient as summed
    }
    return RunSpec(**(base | over))


def own_logprobs(policy: Policy, prompt: list[int], response: list[int]) -> list[float]:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = token_logprobs(
            policy.model(input_ids=ids).logits, ids, policy.spec.sampling.temperature
        )
    return logp[0, len(prompt) - 1 :].tolist()


def make_groups(policy: Policy) -> list[Group]:
    """A step's groups: responses of 1 to BUDGET tokens, the policy's own logprobs (ratio 1),
    rewards that differ within and between groups."""
    rng = random.Random(0)
    groups = []
    for p in range(PROMPTS):
        prompt = [rng.randrange(5, 40) for _ in range(4)]
        responses = []
        for _ in range(RESPONSES):
            tokens = [rng.randrange(5, 40) for _ in range(rng.randint(1, BUDGET))]
            reward = float(rng.choice([0.0, 0.5, 1.0]))
            logprobs = own_logprobs(policy, prompt, tokens)
            responses.append(
                Response(token_ids=tokens, logprobs=logprobs, reward=reward, finish_reason="length")
            )
        groups.append(
            Group(
                run_id="r",
                step=0,
                prompt_index=p,
                prompt_ids=prompt,
                responses=responses,
            )
        )
    return groups


def applied_gradients(policy: Policy) -> list[list[torch.Tensor]]:
    """The gradient of each optimizer step, as the optimizer sees it."""
    seen: list[list[torch.Tensor]] = []

    def capture(optimizer, args, kwargs):
        seen.append([p.grad.clone() for p in policy.model.parameters()])

    policy.optimizer.register_step_pre_hook(capture)
    return seen


def whole_step_gradient(policy: Policy, groups: list[Group]) -> list[torch.Tensor]:
    """The step's gradient the plain way: the exact advantages and sizes, response by response."""
    spec = policy.spec
    advantages = step_advantages(
        [[r.reward for r in g.responses] for g in groups], spec.loss.scale_rewards
    )
    tokens = sum(len(r.token_ids) for g in groups for r in g.responses)
    size = StepSize(PROMPTS * RESPONSES, BUDGET, tokens)
    for g, group_adv in zip(groups, advantages, strict=True):
        for r, adv in zip(g.responses, group_adv, strict=True):
            ids = torch.tensor([g.prompt_ids + r.token_ids])
            start = len(g.prompt_ids) - 1
            logp = token_logprobs(
                policy.model(input_ids=ids).logits, ids, spec.sampling.temperature
            )[:, start:]
            ref = None
            if policy.ref is not None:
                with torch.no_grad():
                    ref = token_logprobs(
                        policy.ref(input_ids=ids).logits, ids, spec.sampling.temperature
                    )[:, start:]
            parts = grpo_loss(
                logp,
                torch.tensor([r.logprobs]),
                torch.tensor([adv], dtype=torch.float32),
                torch.ones_like(logp),
                size,
                epsilon=spec.loss.epsilon,
                loss_type=spec.loss.loss_type,
                ref_logprobs=ref,
                beta=spec.loss.beta,
            )
            parts.loss.backward()
    return [p.grad.clone() for p in policy.model.parameters()]


@pytest.mark.parametrize(
    ("loss_type", "scale_rewards", "beta", "deferred"),
    [
        ("grpo", "group", 0.0, False),
        ("dr_grpo", "none", 0.0, False),
        ("dapo", "batch", 0.0, False),  # both rescaled at the end of the step
        ("bnpo", "group", 0.0, False),
        ("dapo", "batch", 0.05, True),  # the batch std with a KL term waits for the step's end
    ],
)
def test_the_pipelined_gradient_is_the_whole_steps(
    tiny_model, loss_type, scale_rewards, beta, deferred
):
    over = {"micro_batch_size": 1} if loss_type == "bnpo" else {}
    spec = knobs(tiny_model, loss_type=loss_type, scale_rewards=scale_rewards, beta=beta, **over)
    policy = Policy(tiny_model, spec)
    assert policy.deferred == deferred
    groups = make_groups(policy)
    seen = applied_gradients(policy)
    policy.accumulate(groups[:1])  # the groups arrive in two reads
    policy.accumulate(groups[1:])
    row = policy.optimizer_step()
    # bnpo over micro-batches of one response each is grpo
    grpo = spec.loss.model_copy(update={"loss_type": "grpo"})
    reference_spec = spec.model_copy(update={"loss": grpo}) if loss_type == "bnpo" else spec
    reference = whole_step_gradient(Policy(tiny_model, reference_spec), groups)
    for got, want in zip(seen[0], reference, strict=True):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-7)
    assert row.trained_sequences == PROMPTS * RESPONSES and row.clip_fraction == 0.0


def test_num_iterations_steps_again_off_the_rollout_policy(tiny_model):
    rows = {}
    for iterations in (1, 2):
        spec = knobs(
            tiny_model, num_iterations=iterations, learning_rate=1e-2, epsilon=1e-3, beta=0.1
        )
        policy = Policy(tiny_model, spec)
        policy.accumulate(make_groups(policy))
        rows[iterations] = policy.optimizer_step()
        assert policy.optimizer.state_dict()["state"][0]["step"] == iterations
        assert policy.scheduler.last_epoch == iterations
    # the first optimizer step is at the rollout policy (ratio 1, nothing clipped, at the
    # reference); the second, after it, sees ratios off 1 and a KL
    assert rows[1].clip_fraction == 0.0 and rows[1].kl == pytest.approx(0.0, abs=1e-6)
    assert rows[2].clip_fraction > 0.0 and rows[2].kl > 0.0
    assert rows[2].trained_sequences == rows[1].trained_sequences


def test_beta_creates_the_reference_model(tiny_model):
    assert Policy(tiny_model, knobs(tiny_model)).ref is None
    ref = Policy(tiny_model, knobs(tiny_model, beta=0.01)).ref
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())


def test_adam_settings_reach_the_optimizer(tiny_model):
    from transformers import Trainer

    spec = knobs(tiny_model, adam_beta1=0.8, adam_beta2=0.95, weight_decay=0.1, learning_rate=3e-5)
    policy = Policy(tiny_model, spec)
    decay, no_decay = policy.optimizer.param_groups
    assert decay["betas"] == (0.8, 0.95) and decay["lr"] == 3e-5
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in policy.model.named_parameters()}
    # transformers' Trainer decays the same parameters (not biases, not norm weights)
    theirs = set(Trainer.get_decay_parameter_names(None, policy.model))  # type: ignore[arg-type]
    assert {names[id(p)] for p in decay["params"]} == theirs


def ones_step(policy: Policy) -> float:
    for p in policy.model.parameters():
        p.grad = torch.ones_like(p)
    return policy.optimizer_step().grad_norm or 0.0


def test_max_grad_norm_clips_and_zero_does_not(tiny_model):
    for limit in (0.5, 0.0):
        policy = Policy(tiny_model, knobs(tiny_model, max_grad_norm=limit))
        seen = applied_gradients(policy)
        norm = ones_step(policy)
        n = sum(p.numel() for p in policy.model.parameters())
        assert norm == pytest.approx(n**0.5)  # reported before clipping
        applied = torch.linalg.vector_norm(torch.cat([g.flatten() for g in seen[0]]))
        assert applied.item() == pytest.approx(limit or n**0.5, rel=1e-4)


def test_the_lr_schedule_resumes_from_the_policy_state(tiny_model):
    spec = knobs(tiny_model, steps=6, lr_scheduler_type="cosine", warmup_steps=2)
    a = Policy(tiny_model, spec)
    for _ in range(3):
        ones_step(a)
    b = Policy(tiny_model, spec)
    b.load_state(a.state())
    assert b.scheduler.last_epoch == 3
    for _ in range(2):
        assert b.optimizer.param_groups[0]["lr"] == pytest.approx(a.optimizer.param_groups[0]["lr"])
        ones_step(a), ones_step(b)
    assert b.optimizer.param_groups[0]["lr"] < spec.optimizer.learning_rate / 2  # past the middle


def test_a_trainer_resumed_from_the_weight_store_takes_up_the_schedule(tiny_model):
    from services.contracts.runspec import RunSpec
    from services.trainer.policy import Policy

    spec = RunSpec(model=str(tiny_model), steps=10, num_iterations=2, lr_scheduler_type="linear")
    policy = Policy(tiny_model, spec)
    policy.schedule_at(4)  # 8 of 20 optimizer steps done
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * (1 - 8 / 20))
    assert policy.scheduler.get_last_lr()[0] == pytest.approx(1e-4 * (1 - 8 / 20))
    policy.optimizer.step()  # no gradients: nothing moves
    policy.scheduler.step()
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * (1 - 9 / 20))


def test_micro_batches_are_full_however_the_groups_arrive(tiny_model):
    """Rows short of a micro-batch wait for the next read (or the step's end): a step of 12
    responses in micro-batches of 5 makes 3 passes (5, 5, 2) whether its groups come at once or
    one by one, with the same gradient."""
    grads = []
    for reads in ([slice(0, 3)], [slice(0, 1), slice(1, 2), slice(2, 3)]):
        policy = Policy(tiny_model, knobs(tiny_model, micro_batch_size=5))
        policy.skips_flat_groups = False  # every response is a row here
        groups = make_groups(policy)
        sizes: list[int] = []
        backward = policy._backward

        def counted(rows, *args, _sizes=sizes, _backward=backward, **kwargs):
            _sizes.append(len(rows))
            return _backward(rows, *args, **kwargs)

        policy._backward = counted
        seen = applied_gradients(policy)
        for read in reads:
            policy.accumulate(groups[read])
        policy.optimizer_step()
        assert sizes == [5, 5, 2]
        grads.append(seen[0])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def flatten_rewards(groups: list[Group], which: list[int]) -> list[Group]:
    """The groups, those at `which` with every reward equal (their advantages all 0)."""
    out = []
    for i, g in enumerate(groups):
        if i in which:
            responses = [msgspec.structs.replace(r, reward=1.0) for r in g.responses]
            g = msgspec.structs.replace(g, responses=responses)
        out.append(g)
    return out


@pytest.mark.parametrize(
    ("loss_type", "scale_rewards"), [("grpo", "group"), ("dr_grpo", "none"), ("dapo", "batch")]
)
def test_zero_advantage_responses_are_not_run_and_the_step_is_the_same(
    tiny_model, loss_type, scale_rewards
):
    """A group of equal rewards adds nothing to a sum-over-responses loss without KL: its
    responses never reach the model, and the gradient and the metrics are those of training
    them."""
    spec = knobs(tiny_model, loss_type=loss_type, scale_rewards=scale_rewards)
    results = {}
    for skip in (True, False):
        policy = Policy(tiny_model, spec)
        policy.skips_flat_groups = skip
        groups = flatten_rewards(make_groups(policy), [0])  # make_groups' group 1 is flat too
        seen = applied_gradients(policy)
        rows_run = []
        forward = policy.scorer.forward

        def counting(*args, _forward=forward, _rows=rows_run, **kwargs):
            _rows.append(int(args[5].sum().item()))  # response tokens of the micro-batch
            return _forward(*args, **kwargs)

        policy.scorer.forward = counting
        policy.accumulate(groups[:1])
        policy.accumulate(groups[1:])
        row = policy.optimizer_step()
        results[skip] = (seen[0], row, sum(rows_run))
        if skip:
            reference = whole_step_gradient(Policy(tiny_model, spec), groups)
    (skip_grad, skip_row, skip_tokens), (full_grad, full_row, full_tokens) = results.values()
    assert skip_tokens == sum(len(r.token_ids) for r in groups[2].responses)
    assert full_tokens == sum(len(r.token_ids) for g in groups for r in g.responses)
    for got, plain, want in zip(skip_grad, full_grad, reference, strict=True):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-7)
        assert torch.allclose(got, plain, rtol=1e-4, atol=1e-7)
    assert skip_row.trained_sequences == full_row.trained_sequences == PROMPTS * RESPONSES
    assert skip_row.trained_tokens == full_row.trained_tokens
    assert skip_row.policy_loss == pytest.approx(full_row.policy_loss, abs=1e-6)
    assert skip_row.clip_fraction == full_row.clip_fraction


def test_a_step_of_equal_rewards_only_steps_the_optimizer_as_training_it_would(tiny_model):
    """Nothing to run, yet the optimizer steps on a zero gradient (weight decay, momentum)."""
    weights = {}
    for skip in (True, False):
        spec = knobs(tiny_model, learning_rate=1e-2, weight_decay=0.1)
        policy = Policy(tiny_model, spec)
        policy.skips_flat_groups = False  # the same first step (Adam magnifies float rounding)
        policy.accumulate(make_groups(policy))  # a first step with a gradient: momentum
        policy.optimizer_step()
        policy.skips_flat_groups = skip
        policy.accumulate(flatten_rewards(make_groups(policy), [0, 1, 2]))
        row = policy.optimizer_step()
        assert row.trained_sequences == PROMPTS * RESPONSES and row.grad_norm == 0.0
        weights[skip] = [p.detach().clone() for p in policy.model.parameters()]
    for a, b in zip(weights[True], weights[False], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)

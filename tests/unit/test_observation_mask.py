"""The trainer masks what the model did not generate (issue 40, part 4): a multi-turn response's
observation tokens (`Response.observed`) are context for the tokens after them and weigh in
nothing else. On the tiny model (fp32, CPU): trajectories like prompt + g1 + o1 + g2 give the
loss and gradient of their generated tokens alone, computed by hand from one forward pass of the
whole sequence with the logprobs taken at the generated positions only: each loss_type, padded
and packed, with a KL term, with stale tokens, and through a whole step (`accumulate`). The span
helper refuses bad spans, and the trainer's intake parks a group that has them."""

import dataclasses
import math
import random
import re

import pytest
import torch

from services.contracts.messages import Group, MalformedMessage, Response
from services.contracts.runspec import RunSpec
from services.contracts.spans import InvalidSpans, generated_count, generated_mask, span_error
from services.infra.redis_streams import Read
from services.trainer.batching import Row
from services.trainer.grpo import StepSize, group_advantages, token_logprobs
from services.trainer.intake import StepIntake
from services.trainer.policy import Policy

BUDGET = 16  # max_new_tokens
LAYOUTS = {"padded": {}, "packed": {"max_tokens_per_micro_batch": 1000}}
GEN, OBS = True, False  # a piece of a response: generated, or an observation


# the span helper


def test_spans_become_the_generated_mask():
    assert generated_mask([], 4) is None
    assert span_error([(0, 6)], 6) is None
    assert generated_mask([(1, 2), (3, 1), (5, 1)], 6) == [True, False, False, False, True, False]
    assert generated_count([(1, 2), (5, 1)], 6) == 3
    assert generated_count([], 6) == 6


@pytest.mark.parametrize(
    ("spans", "why"),
    [
        ([(2, 1), (0, 1)], "span 1 (0, 1) starts before 3"),  # out of order
        ([(0, 3), (2, 2)], "span 1 (2, 2) starts before 3"),  # overlapping
        ([(-1, 2)], "starts before 0"),
        ([(1, 0)], "span 0 (1, 0) is empty"),
        ([(4, 3)], "ends past the response's 6 tokens"),
        ([(6, 1)], "ends past the response's 6 tokens"),
    ],
)
def test_bad_spans_are_refused(spans, why):
    assert why in (span_error(spans, 6) or "")
    with pytest.raises(InvalidSpans, match=re.escape(why)):
        generated_mask(spans, 6)


def test_a_response_decodes_its_spans_and_refuses_empty_ones():
    resp = Response(
        token_ids=[1, 2, 3], logprobs=[-0.1, 0.0, -0.2], reward=1.0, finish_reason="stop"
    )
    assert Response.decode(resp.encode()).observed == []  # single-turn: every token generated
    turn = resp.replace(observed=[(1, 1)])
    assert Response.decode(turn.encode()).observed == [(1, 1)]
    with pytest.raises(MalformedMessage, match="observed"):
        Response.decode(resp.replace(observed=[(1, 0)]).encode())


def test_the_intake_parks_a_group_whose_spans_do_not_fit():
    def group(prompt: int, observed: list[tuple[int, int]]) -> Group:
        responses = [
            Response(token_ids=[3, 4, 5], logprobs=[-0.1] * 3, reward=1.0, finish_reason="stop"),
            Response(
                token_ids=[3, 4, 5], logprobs=[-0.1, 0, -0.1], reward=0.0, finish_reason="stop"
            ).replace(observed=observed),
        ]
        return Group(run_id="r", step=5, prompt_index=prompt, prompt_ids=[1], responses=responses)

    good, bad = group(0, [(1, 1)]), group(1, [(2, 2)])
    messages = [(b"0-0", good), (b"1-0", bad)]
    read = Read([(i, g.fields()) for i, g in messages], messages, [])
    intake = StepIntake("r", 5, prompts=2, group_size=2)
    assert intake.take(read) == [good]
    assert read.parked == [
        (b"1-0", "response 1 of group 1: observed span 0 (2, 2) ends past the response's 3 tokens")
    ]
    assert intake.missing == 1


# the loss, by hand


def spec_for(tiny_model, **over) -> RunSpec:
    base = {
        "model": str(tiny_model),
        "prompts_per_step": 2,
        "group_size": 3,
        "max_new_tokens": BUDGET,
        "micro_batch_size": 8,
        "max_grad_norm": 0.0,  # the optimizer's hook sees the gradient as summed
    }
    return RunSpec(**(base | over))


def own_logprobs(policy: Policy, prompt: list[int], response: list[int]) -> list[float]:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = policy.model(input_ids=ids).logits
    logp = token_logprobs(logits, ids, policy.spec.sampling.temperature)
    return logp[0, len(prompt) - 1 :].tolist()


def response_of(
    policy: Policy,
    prompt: list[int],
    pieces: list[tuple[bool, int]],
    rng: random.Random,
    reward: float = 0.0,
    placeholder: float = 0.0,
) -> Response:
    """A response made of generated and observation pieces (kind, tokens). Generated tokens
    carry the policy's own logprobs moved by up to +-0.3 (ratios off 1, some clipped);
    observation tokens carry `placeholder`."""
    tokens: list[int] = []
    observed = []
    for kind, n in pieces:
        if kind is OBS:
            observed.append((len(tokens), n))
        tokens += [rng.randrange(5, 40) for _ in range(n)]
    generated = generated_mask(observed, len(tokens)) or [True] * len(tokens)
    logprobs = [
        lp + rng.uniform(-0.3, 0.3) if g else placeholder
        for lp, g in zip(own_logprobs(policy, prompt, tokens), generated, strict=True)
    ]
    return Response(
        token_ids=tokens, logprobs=logprobs, reward=reward, finish_reason="stop", observed=observed
    )


@dataclasses.dataclass
class Item:
    """One trajectory to train on: its prompt, response, advantage, whether it is stale."""

    prompt: list[int]
    response: Response
    advantage: float
    stale: bool = False

    def row(self) -> Row:
        r, n = self.response, len(self.response.token_ids)
        stale = [True] * n if self.stale else None  # observation tokens included
        generated = generated_mask(r.observed, n)
        return Row(self.prompt, r.token_ids, r.logprobs, self.advantage, stale, generated)


def trajectories(policy: Policy) -> list[Item]:
    rng = random.Random(0)
    prompt_a, prompt_b = [7, 8, 9, 10], [11, 12]
    return [
        Item(prompt_a, response_of(policy, prompt_a, [(GEN, 3), (OBS, 4), (GEN, 3)], rng), 1.0),
        Item(
            prompt_b,
            response_of(policy, prompt_b, [(GEN, 2), (OBS, 2), (GEN, 1), (OBS, 3)], rng),
            -0.5,
        ),
        Item(prompt_a, response_of(policy, prompt_a, [(GEN, 5)], rng), 0.7),  # single-turn
        Item(
            prompt_b,
            response_of(
                policy,
                prompt_b,
                [(GEN, 4), (OBS, 2), (GEN, 2), (OBS, 1), (GEN, 3)],
                rng,
                placeholder=math.nan,
            ),
            -1.2,
        ),
    ]


def by_hand(policy: Policy, items: list[Item], sequences: int) -> dict[str, torch.Tensor]:
    """The loss the plain way: per trajectory one forward pass of prompt + response, the token
    losses at its generated positions only, aggregated by the loss_type's formula; and the
    statistics (policy loss and KL as means over responses, clip fraction over tokens)."""
    spec = policy.spec
    eps, temperature, beta = spec.loss.epsilon, spec.sampling.temperature, spec.loss.beta
    high = spec.loss.epsilon_high or eps
    losses, policies, kls, clipped = [], [], [], []
    for item in items:
        ids = torch.tensor([item.prompt + item.response.token_ids])
        n = len(item.response.token_ids)
        keep = torch.tensor(generated_mask(item.response.observed, n) or [True] * n)
        start = len(item.prompt) - 1
        logp = token_logprobs(policy.model(input_ids=ids).logits, ids, temperature)[0, start:][keep]
        behaviour = torch.tensor(item.response.logprobs)[keep]
        adv = item.advantage
        weight = torch.ones_like(logp)
        old = behaviour
        if item.stale:  # decoupled PPO: the ratio to the proximal policy, the behaviour's weight
            old = logp.detach()
            weight = torch.exp(logp.detach() - behaviour).clamp(max=spec.loss.behaviour_cap)
        ratio = torch.exp(logp - old)
        term = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + high) * adv) * weight
        kl = torch.zeros_like(term)
        if beta > 0:
            assert policy.ref is not None
            with torch.no_grad():
                ref = token_logprobs(policy.ref(input_ids=ids).logits, ids, temperature)
            log_ratio = ref[0, start:][keep] - logp
            kl = torch.exp(log_ratio) - log_ratio - 1
        losses.append(term + beta * kl)
        policies.append(term.mean().detach())
        kls.append(kl.mean().detach())
        clipped.append(((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0)))
    total = torch.stack([t.sum() for t in losses]).sum()
    tokens = sum(len(t) for t in losses)
    loss_type = spec.loss.loss_type
    if loss_type == "grpo":
        loss = torch.stack([t.mean() for t in losses]).sum() / sequences
    elif loss_type == "dapo":
        loss = total / tokens
    elif loss_type == "dr_grpo":
        loss = total / (sequences * BUDGET)
    else:  # bnpo, the items one micro-batch
        loss = len(items) / sequences * total / tokens
    return {
        "loss": loss,
        "policy": torch.stack(policies).mean(),
        "kl": torch.stack(kls).mean(),
        "clip_fraction": torch.cat(clipped).float().sum() / tokens,
        "tokens": torch.tensor(tokens),
    }


def gradient_of(policy: Policy, loss: torch.Tensor) -> list[torch.Tensor]:
    policy.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad.clone() for p in policy.model.parameters()]
    policy.optimizer.zero_grad(set_to_none=True)
    return grads


def assert_same_gradient(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert any(g.abs().max() > 1e-4 for g in want)  # a gradient worth comparing
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def perturbed(policy: Policy) -> Policy:
    """The policy moved off its reference copy, so that the KL term has a value and a gradient."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return policy


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("loss_type", "beta"),
    [("grpo", 0.0), ("dapo", 0.0), ("dr_grpo", 0.0), ("bnpo", 0.0), ("grpo", 0.1), ("dapo", 0.1)],
)
def test_observations_are_context_and_nothing_else(tiny_model, layout, loss_type, beta):
    spec = spec_for(tiny_model, loss_type=loss_type, beta=beta, **LAYOUTS[layout])
    policy = Policy(tiny_model, spec)
    if beta:
        perturbed(policy)
    items = trajectories(policy)
    rows = [item.row() for item in items]
    tokens = sum(r.generated_tokens for r in rows)
    assert tokens == 3 + 3 + 2 + 1 + 5 + 4 + 2 + 3
    parts = policy._loss(rows, StepSize(len(rows), BUDGET, tokens), 1.0)
    want = by_hand(policy, items, len(rows))
    assert parts.tokens == tokens
    assert parts.loss.item() == pytest.approx(want["loss"].item(), abs=1e-6)
    for stat in ("policy", "kl", "clip_fraction"):
        assert getattr(parts, stat) == pytest.approx(want[stat].item(), abs=1e-6), stat
    assert want["clip_fraction"] > 0 and (want["kl"] > 0) == (beta > 0)
    assert_same_gradient(gradient_of(policy, parts.loss), gradient_of(policy, want["loss"]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stale_tokens_and_observations_combine(tiny_model, layout):
    """Asynchronous RL: stale rows take decoupled PPO's loss over their generated tokens only
    (their observation tokens are marked stale too, and still count for nothing)."""
    policy = Policy(tiny_model, spec_for(tiny_model, loss_type="dapo", **LAYOUTS[layout]))
    items = trajectories(policy)
    items[0].stale = items[3].stale = True
    rows = [item.row() for item in items]
    tokens = sum(r.generated_tokens for r in rows)
    parts = policy._loss(rows, StepSize(len(rows), BUDGET, tokens), 1.0)
    want = by_hand(policy, items, len(rows))
    assert parts.loss.item() == pytest.approx(want["loss"].item(), abs=1e-6)
    assert_same_gradient(gradient_of(policy, parts.loss), gradient_of(policy, want["loss"]))


def test_a_row_with_no_observation_is_trained_as_before(tiny_model):
    policy = Policy(tiny_model, spec_for(tiny_model))
    items = [it for it in trajectories(policy) if not it.response.observed]
    rows = [item.row() for item in items]
    assert all(r.generated is None for r in rows)
    marked = [dataclasses.replace(r, generated=[True] * len(r.response_ids)) for r in rows]
    size = StepSize(len(rows), BUDGET, sum(len(r.response_ids) for r in rows))
    a, b = policy._loss(rows, size, 1.0), policy._loss(marked, size, 1.0)
    assert a.loss.item() == b.loss.item() and a.tokens == b.tokens
    for x, y in zip(gradient_of(policy, a.loss), gradient_of(policy, b.loss), strict=True):
        assert torch.equal(x, y)


def groups_of(policy: Policy) -> list[Group]:
    """A step of two groups of three multi-turn responses; the second group's rewards are all
    equal (zero advantages: skipped under grpo and dapo without a KL term)."""
    rng = random.Random(3)
    shapes = [
        [(GEN, 3), (OBS, 4), (GEN, 3)],
        [(GEN, 2), (OBS, 2), (GEN, 1), (OBS, 3)],
        [(GEN, 5)],
    ]
    groups = []
    for index, rewards in enumerate(([1.0, 0.0, 0.25], [1.0, 1.0, 1.0])):
        prompt = [rng.randrange(5, 40) for _ in range(3 + index)]
        responses = [
            response_of(policy, prompt, shape, rng, reward, placeholder=math.nan)
            for shape, reward in zip(shapes, rewards, strict=True)
        ]
        groups.append(
            Group(
                run_id="r",
                step=0,
                prompt_index=index,
                prompt_ids=prompt,
                responses=responses,
            )
        )
    return groups


@pytest.mark.parametrize("layout", [{"micro_batch_size": 2}, {"max_tokens_per_micro_batch": 20}])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_step_trains_the_generated_tokens_only(tiny_model, layout, loss_type):
    """Through `accumulate` and `optimizer_step`: the gradient the optimizer applies is the hand
    one (dapo's divisor the step's generated tokens), and the step's metrics count generated
    tokens only, the skipped flat group's included."""
    spec = spec_for(tiny_model, loss_type=loss_type, **layout)
    policy = Policy(tiny_model, spec)
    groups = groups_of(policy)
    seen: list[list[torch.Tensor]] = []
    policy.optimizer.register_step_pre_hook(
        lambda *_: seen.append([p.grad.clone() for p in policy.model.parameters()])
    )
    policy.accumulate(groups[:1])
    policy.accumulate(groups[1:])
    generated = [generated_count(r.observed, len(r.token_ids)) for g in groups for r in g.responses]
    assert policy.tokens == sum(generated) == 28
    assert policy.skipped.sequences == 3 and policy.skipped.tokens == sum(generated[3:])
    row = policy.optimizer_step()
    assert row.trained_sequences == 6 and row.trained_tokens == sum(generated)
    reference = Policy(tiny_model, spec)
    items = [
        Item(g.prompt_ids, r, adv)
        for g in groups
        for r, adv in zip(
            g.responses, group_advantages([r.reward for r in g.responses]), strict=True
        )
    ]
    want = by_hand(reference, items, sequences=6)
    assert_same_gradient(seen[0], gradient_of(reference, want["loss"]))
    assert row.policy_loss == pytest.approx(want["policy"].item(), abs=1e-6)

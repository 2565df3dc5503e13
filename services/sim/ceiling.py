"""The trace's ceiling: the most response tokens a second that one reserved node and the spot
instances a trace offers could train, so that every system's throughput also reads as a share
of what the trace allows (issue 50).

Two rates bound it. Rollout: every instance the trace offers generates at its plateau the
whole time (the time-mean of the instances offered, no boot, no pull, no tail), plus the
reserved node's engines for the time it generates. Training: the reserved node trains the
whole time it does not generate, never waiting for a group, at the trainer's rate over the
response and prompt tokens of a mean step, plus one optimizer step a step (the publication can
overlap the next step's training, as under asynchronous RL, so it is not counted). The node's
time is shared between the two: with S the pool's rate, G the node's generation rate and T its
training rate (response tokens a second), the best share f of generation makes S + f G =
(1 - f) T, so the ceiling is T where S >= T, else T (G + S) / (G + T). Over the whole window:
groups generated early may be trained late, so the rates are averaged before the bound.

An engine's plateau is its best tokens a second over batch sizes up to its `max_seqs`, at the
context a generated token sees on average (the prompt plus, token-weighted, half the response:
E[L^2] / 2 E[L]), the KV cache's limit applied as the engine applies it (engine.py). With
speculation every row drafts and a step yields the acceptance model's mean tokens (over the
requests' acceptances), at the verification's price.

What it does not bound: systems that buy capacity outside the trace (reserved-x2's second
node, disagg-bal's on-demand pool) can in principle pass it; the figures in
docs/simulation.md stay below.
"""

import random
from dataclasses import dataclass

from services.sim.profile import EngineProfile
from services.sim.scenario import Scenario
from services.sim.tail import SpeculationModel, verify_step

WORKLOAD_STEPS = 32  # steps of the workload drawn for its mean lengths
ALPHA_SAMPLES = 2000  # requests' acceptances drawn for the mean tokens a drafted step yields


@dataclass(frozen=True)
class Ceiling:
    throughput_tok_s: float  # response tokens trained a second, at most
    pool_tok_s: float  # S: the offered instances at their plateau
    reserved_gen_tok_s: float  # G: the reserved node's engines at their plateau
    train_tok_s: float  # T: response tokens the node trains a second, never waiting


def mean_offered(targets: list[tuple[float, int]], horizon_s: float) -> float:
    """The time-mean of the instances the trace offers over [0, horizon_s]."""
    if horizon_s <= 0:
        return 0.0
    total, at, count = 0.0, 0.0, 0
    for t, n in sorted(targets):
        t = min(max(t, 0.0), horizon_s)
        total += (t - at) * count
        at, count = t, n
    return (total + (horizon_s - at) * count) / horizon_s


def mean_step_tokens(scenario: Scenario, seed: int) -> tuple[float, float, float]:
    """Mean response tokens, prompt tokens a request, and the mean context a generated token
    sees (prompt + E[L^2] / 2 E[L])."""
    lengths, prompts = [], []
    for step in range(WORKLOAD_STEPS):
        work = scenario.workload.step(seed, step)
        for p, group in enumerate(work.response_tokens):
            lengths.extend(group)
            prompts.extend([work.prompt_tokens[p]] * len(group))
    mean_len = sum(lengths) / len(lengths)
    mean_prompt = sum(prompts) / len(prompts)
    position = sum(n * n for n in lengths) / (2 * sum(lengths))
    return mean_len, mean_prompt, mean_prompt + position


def drafted_tokens(spec: SpeculationModel) -> float:
    """The mean tokens a drafted step yields over the requests' acceptances."""
    rng = random.Random("ceiling")
    alphas = [spec.request_alpha(rng) for _ in range(ALPHA_SAMPLES)]
    return sum(spec.mean_tokens(a) for a in alphas) / len(alphas)


def plateau_tok_s(
    profile: EngineProfile, context: float, spec: SpeculationModel | None = None
) -> float:
    """An engine's best tokens a second at `context`, over batch sizes up to `max_seqs`."""
    verify = verify_step(profile, spec)
    per_step = drafted_tokens(spec) if spec is not None else 1.0
    best = 0.0
    for batch in range(1, profile.max_seqs + 1):
        rows = batch * min(1.0, profile.kv_capacity_tokens / (batch * context))
        step = verify(rows, rows, context) if verify else profile.step_s(rows, context)
        best = max(best, rows * per_step / step)
    return best


def ceiling(
    scenario: Scenario, targets: list[tuple[float, int]], horizon_s: float, seed: int = 0
) -> Ceiling:
    """The trace's ceiling for one reserved node (see the module doc)."""
    mean_len, mean_prompt, context = mean_step_tokens(scenario, seed)
    spec = scenario.tail.speculation
    pool = mean_offered(targets, horizon_s) * plateau_tok_s(scenario.spot_engine, context, spec)
    gen = scenario.reserved_engines * plateau_tok_s(scenario.reserved_engine, context, spec)
    wl, trainer = scenario.workload, scenario.trainer
    requests = wl.prompts_per_step * wl.group_size
    step_s = requests * (mean_len + mean_prompt) / trainer.tokens_per_s + trainer.optimizer_s
    train = requests * mean_len / step_s
    best = train if pool >= train else train * (gen + pool) / (gen + train)
    return Ceiling(best, pool, gen, train)

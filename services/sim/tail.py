"""The long tail's two remedies in the simulation (issue 50), both off by default: speculative
decoding from the run's own history, as a per-request acceptance model, and length-aware
dispatch, longest expected first.

**Speculation** (`SpeculationModel`). A request that has a draft verifies `draft_tokens` k of
it with every decode step and keeps the longest accepted prefix plus the target's own draw at
the first mismatch: a step yields 1 + A tokens, A accepted of k, each draft token accepted
with probability alpha given the ones before (A truncated geometric), so a step yields on
average (1 - alpha^(k+1)) / (1 - alpha) tokens. A request has a draft when the run holds an
earlier response to its prompt (from the second epoch on: `TailPolicy.epoch_steps`) or once
the first sibling of its group finished (the coordinator holds its tokens; Seer's grouped
speculation). Requests differ: each takes its own alpha from a Beta distribution around the
mean (`alpha_concentration`; some responses repeat their history closely, some not at all).
The engine runs its requests in lockstep (engine.py), so a request's accepted tokens are
taken per job segment, not drawn step by step: over N tokens the number of steps is the
renewal count of i.i.d. 1 + A, drawn from its normal limit (mean N / mu, variance
N sigma^2 / mu^3), which is exact in distribution to ~1/sqrt(N) of a response of thousands
of tokens. `draw_tokens` draws one step, for the tests that hold the model to its mean.

Verifying costs more than a plain step: a drafting row feeds k + 1 tokens. With
`verify_cost` None (the default) the engine profile prices it: the step reads the same
weights and KV cache and computes k more tokens a drafting row (`profile.step_s` at the batch
plus k per drafting row, the KV bytes kept), so memory-bound decode on a GPU costs ~1.0-1.1x
at a tail's few rows and ~1.5x at the 112 rows of 6K context a 14B engine on 2xH100 holds
(the roofline's compute term grows, its memory term does not).
A number instead sets the factor of a step where every row drafts (rows without a draft take
a plain step in the same pass: the factor scales with the drafting share). CPU, measured:
the transformers engine's drafted step costs ~1.6x a plain one at k = 4 and 16-64 rows
(docs/benchmarks.md, "Exact speculation in the transformers engine").

The acceptance: `bench/long_tail.py` measured 1.22 tokens a forward pass on `long_addition`
with an under-trained 300-step model (alpha ~0.2 at k = 4), and 3.57 on `countdown` with its
base model (acceptance 0.84 at k = 4, docs/benchmarks.md, "The long tail"); RhymeRL and DAS
report history drafts accepted often on math reasoning. The default alpha 0.6 (2.3 tokens a
step at k = 4) sits between; docs/simulation.md runs 0.2, 0.6 and 0.8.

**Length-aware dispatch** (`TailPolicy.length_aware`). From the second epoch on, each request
has an expected length: the length of the previous epoch's response to the same prompt (the
same sample index), with noise. In the workload that is a fresh draw of the same prompt's
length (its factor kept, the sample's drawn again, workload.py) times a log-normal drift of
`length_noise_sigma` (the policy moved in between). A step's queue is kept longest expected
(remaining) first, and instances take jobs one at a time in turn, so the long ones spread over
the instances rather than filling the first (RhymeRL's HistoPipe, Seer's context-aware
scheduling). Nothing else reads the physics' true lengths.
"""

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from services.sim.profile import EngineProfile


@dataclass(frozen=True)
class SpeculationModel:
    draft_tokens: int = 4  # k, as the transformers engine's default (DRAFT_TOKENS)
    alpha: float = 0.6  # mean per-token acceptance
    alpha_concentration: float = 20.0  # Beta(alpha c, (1 - alpha) c) per request; inf: all alpha
    verify_cost: float | None = None  # a step with every row drafting / plain; None: the profile

    def __post_init__(self) -> None:
        if self.draft_tokens < 1 or not 0.0 <= self.alpha < 1.0:
            raise ValueError("draft_tokens must be >= 1 and alpha within [0, 1)")
        if self.alpha_concentration <= 0 or (self.verify_cost is not None and self.verify_cost < 1):
            raise ValueError("alpha_concentration must be > 0 and verify_cost >= 1")

    def pmf(self, alpha: float) -> list[float]:
        """P(A = j), j = 0..k: each draft token accepted with `alpha` after the ones before."""
        k = self.draft_tokens
        return [alpha**j * (1 - alpha) for j in range(k)] + [alpha**k]

    def mean_tokens(self, alpha: float | None = None) -> float:
        """E[1 + A]: tokens a drafted step yields, (1 - alpha^(k+1)) / (1 - alpha)."""
        a = self.alpha if alpha is None else alpha
        return sum((1 + j) * p for j, p in enumerate(self.pmf(a)))

    def draw_tokens(self, rng: random.Random, alpha: float | None = None) -> int:
        """One drafted step's tokens: 1 + the draft tokens accepted before the first rejection."""
        a = self.alpha if alpha is None else alpha
        accepted = 0
        while accepted < self.draft_tokens and rng.random() < a:
            accepted += 1
        return 1 + accepted

    def request_alpha(self, rng: random.Random) -> float:
        """A request's own acceptance, around the mean."""
        c = self.alpha_concentration
        if math.isinf(c) or self.alpha == 0.0:
            return self.alpha
        return min(rng.betavariate(self.alpha * c, (1 - self.alpha) * c), 0.999)

    def speed(self, tokens: int, alpha: float, rng: random.Random) -> float:
        """Tokens per decode step of a job segment of `tokens` drafted tokens: N / steps, the
        steps drawn from the renewal count's normal limit, within [N / (k + 1), N]."""
        if tokens <= 0:
            return 1.0
        pmf = self.pmf(alpha)
        mu = sum((1 + j) * p for j, p in enumerate(pmf))
        var = sum((1 + j) ** 2 * p for j, p in enumerate(pmf)) - mu * mu
        steps = tokens / mu + rng.gauss(0.0, 1.0) * math.sqrt(tokens * max(var, 0.0) / mu**3)
        steps = min(max(steps, tokens / (self.draft_tokens + 1)), float(tokens))
        return tokens / max(steps, 1e-9)


@dataclass(frozen=True)
class TailPolicy:
    """What a simulated run does about the long tail (issue 50); the default does nothing."""

    speculation: SpeculationModel | None = None
    length_aware: bool = False
    # steps in an epoch (the dataset's prompts / prompts a step): a prompt comes back, with its
    # history, every that many steps; None: every step is in the first epoch (no history)
    epoch_steps: int | None = None
    length_noise_sigma: float = 0.3  # log-normal drift of a prompt's length between epochs

    def __post_init__(self) -> None:
        if self.epoch_steps is not None and self.epoch_steps < 1:
            raise ValueError("epoch_steps must be >= 1")

    @property
    def active(self) -> bool:
        return self.speculation is not None or self.length_aware

    def has_history(self, step: int) -> bool:
        """Whether the step's prompts were seen in an earlier epoch."""
        return self.epoch_steps is not None and step >= self.epoch_steps


def expected_lengths(
    prompt_log_median: list[float],
    group_size: int,
    sigma_sample: float,
    cap: int,
    noise_sigma: float,
    rng: random.Random,
) -> list[list[float]]:
    """Per prompt, per sample: the previous epoch's response length to the same prompt, with
    noise (what length-aware dispatch orders by; see the module doc)."""
    return [
        [
            min(cap, math.exp(mu + rng.gauss(0.0, sigma_sample) + rng.gauss(0.0, noise_sigma)))
            for _ in range(group_size)
        ]
        for mu in prompt_log_median
    ]


def verify_step(
    profile: EngineProfile, model: SpeculationModel | None
) -> Callable[[float, float, float], float] | None:
    """Seconds of a decode step of (rows, drafting rows, mean context) where the drafting rows
    verify k draft tokens each (None without speculation). `verify_cost` None: the profile at
    k more tokens a drafting row with the same KV bytes read (the roofline's compute term
    grows, its memory term does not); else that factor where every row drafts, scaled by the
    drafting share."""
    if model is None:
        return None
    k, cost = model.draft_tokens, model.verify_cost
    if cost is None:

        def priced(rows: float, drafting: float, context: float) -> float:
            fed = rows + k * drafting
            return profile.step_s(fed, context * rows / fed)

        return priced

    def scaled(rows: float, drafting: float, context: float) -> float:
        return profile.step_s(rows, context) * (1 + (cost - 1) * drafting / rows)

    return scaled

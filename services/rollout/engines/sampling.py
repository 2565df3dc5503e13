"""Token sampling of the transformers engine: a decode step's rows drawn at once.

Sampling is reproducible: the token at response position k of a request is drawn with a number
fixed by (request seed, k), so a continuation on another worker (prompt + collected prefix)
draws what an uninterrupted generation would have drawn for the same logits. The number is a
hash of the pair computed in Python, so it is the same on every device and in any batch.
Each row applies, in vLLM's order, the repetition penalty (over the prompt and the response so
far), then greedy or the temperature, top-k and top-p; each token's logprob is under the
distribution it was drawn from (renormalised over what top-k and top-p keep), as vLLM's
"processed_logprobs" are. Rows with none of the filters (the common case) are computed as one
batch; the others one by one.
"""

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from services.contracts.sampling import SamplingParams

MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Draw:
    """What one row's draw depends on besides its logits."""

    sampling: SamplingParams  # the run's temperature, top-k, top-p, repetition penalty
    seed: int
    position: int
    context: Collection[int] = ()  # the tokens before it, for the repetition penalty

    @property
    def plain(self) -> bool:
        """Sampled at a temperature with no filter: computed with the batch."""
        return self.sampling.plain


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) fixed by (seed, position): splitmix64 of the pair, 53 bits of it."""
    x = (seed * 1_000_003 + position + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((x ^ (x >> 31)) >> 11) / float(1 << 53)


def penalise_repeats(
    logits: torch.Tensor, context: Collection[int], penalty: float
) -> torch.Tensor:
    """The repetition penalty of transformers and vLLM: the logit of every token in `context`
    divided by `penalty` where positive, multiplied by it where negative."""
    if penalty == 1.0 or not context:
        return logits
    seen = torch.tensor(sorted(set(context)), dtype=torch.long, device=logits.device)
    scores = logits[seen]
    return logits.index_copy(0, seen, torch.where(scores > 0, scores / penalty, scores * penalty))


def keep_likeliest(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs renormalised over the tokens top-k keeps (ties with the k-th included), then
    over those top-p keeps of these (the fewest likeliest whose mass reaches top_p); -inf
    elsewhere."""
    if 0 < top_k < logp.numel():
        kth = torch.topk(logp, top_k).values[-1]
        logp = torch.log_softmax(logp.masked_fill(logp < kth, -math.inf), dim=-1)
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, descending=True)
        p = sorted_logp.exp()
        dropped = order[torch.cumsum(p, 0) - p >= top_p]
        logp = torch.log_softmax(logp.index_fill(0, dropped, -math.inf), dim=-1)
    return logp


def row_logprobs(logits: torch.Tensor, d: Draw) -> torch.Tensor:
    """One row's log-probs under the distribution its token is drawn from (greedy: the
    penalised logits' log-softmax)."""
    sp = d.sampling
    logits = penalise_repeats(logits, d.context, sp.repetition_penalty)
    if sp.temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    return keep_likeliest(torch.log_softmax(logits / sp.temperature, dim=-1), sp.top_k, sp.top_p)


def inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability passes u of the row's mass; never
    a token of probability 0."""
    p = logp.exp().double()
    cdf = torch.cumsum(p, dim=-1)
    tokens = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True)
    last_kept = p.shape[-1] - 1 - torch.argmax((p > 0).flip(-1).int(), dim=-1)
    return torch.minimum(tokens.squeeze(1), last_kept)


def sample_rows(logits: torch.Tensor, draws: list[Draw]) -> list[tuple[int, float]]:
    """Draw one token per row of `logits` (rows x vocabulary); (token, its logprob) each."""
    logits = logits.float()
    temps = torch.tensor([d.sampling.temperature if d.plain else 1.0 for d in draws]).to(
        logits.device
    )
    logp = torch.log_softmax(logits / temps.unsqueeze(1), dim=-1)
    for i, d in enumerate(draws):
        if not d.plain:
            logp[i] = row_logprobs(logits[i], d)
    u = torch.tensor([uniform(d.seed, d.position) for d in draws], dtype=torch.float64)
    u = u.to(logits.device)
    tokens = inverse_cdf(logp, u)
    for i, d in enumerate(draws):
        if d.sampling.temperature == 0:
            tokens[i] = torch.argmax(logp[i])
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return list(zip(tokens.tolist(), chosen.tolist(), strict=True))


def sample_token(
    logits: torch.Tensor,
    sampling: SamplingParams,
    seed: int,
    position: int,
    context: Collection[int] = (),
) -> tuple[int, float]:
    """Draw one token from a row of logits, `context` being the tokens before it (prompt and
    response): what `sample_rows` draws for that row in any batch."""
    draw = Draw(sampling, seed, position, context)
    return sample_rows(logits.unsqueeze(0), [draw])[0]

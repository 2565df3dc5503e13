"""The pieces of the transformers engine's exact speculative decoding (engines/hf.py says how a
step runs): the draw at each draft position, the walk that keeps the tokens the engine itself
draws, the cache columns of rejected draft tokens dropped, and the counters.

A draft is checked against the engine's own seeded draw at each position (`sampling.uniform`
of the request's seed and the response position, the same penalties, temperature, top-k and
top-p as a plain step), so the tokens kept are those plain decoding draws: a draft changes how
many tokens a forward pass yields, never which.
"""

from dataclasses import dataclass
from typing import Any

import torch

from services.rollout.engines.base import Sequence
from services.rollout.engines.sampling import Draw


@dataclass
class SpecStats:
    """Counters of speculative decoding, for one request or a whole engine."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, equal to the engine's own draw (kept)
    forwards: int = 0  # forward passes a request took part in (a batch's rows each count)
    tokens: int = 0  # tokens those passes yielded

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def add(self, drafted: int, accepted: int, tokens: int) -> None:
        """One forward pass of one request."""
        self.drafted += drafted
        self.accepted += accepted
        self.forwards += 1
        self.tokens += tokens


def draws_at(seq: Sequence, draft: list[int]) -> list[Draw]:
    """The draws at a request's next position and at each of its draft tokens' positions: what
    plain decoding draws there once the tokens before them are the draft's."""
    job = seq.job
    sampling = job.sampling
    penalised = sampling.repetition_penalty != 1.0
    context = seq.context if penalised else []
    return [
        Draw(sampling, job.seed, seq.offset + j, context + draft[:j] if penalised else ())
        for j in range(len(draft) + 1)
    ]


def kept_tokens(draft: list[int], drawn: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The draws a step keeps: those up to the first that differs from its draft token, that
    one included (the draft's tokens after it were drawn from a context plain decoding never
    had); all of them, one past the draft, when every draft token is drawn."""
    for j, (token, _) in enumerate(drawn[: len(draft)]):
        if token != draft[j]:
            return drawn[: j + 1]
    return drawn[: len(draft) + 1]


def drop_tail(layers: Any, attn: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """Drop the last `drop[b]` cache columns of each row b (the positions of its rejected draft
    tokens, or padding), keeping the cache left-padded: each row's columns move right by its
    `drop[b]`, the dropped ones wrapping round to the front where the mask hides them.
    `layers`' keys and values are replaced; the new attention mask is returned."""
    width = attn.shape[1]
    cols = torch.arange(width)
    source = (cols.unsqueeze(0) - drop.unsqueeze(1)) % width  # new[b, t] = old[b, source[b, t]]
    attn = attn.masked_fill(cols.unsqueeze(0) >= width - drop.unsqueeze(1), 0).gather(1, source)
    for layer in layers:
        layer.keys = shift_columns(layer.keys, source)
        layer.values = shift_columns(layer.values, source)
    return attn


def shift_columns(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`t` (rows x heads x columns x dim) with column c of row b taken from `source[b, c]`."""
    return t.gather(2, source.to(t.device)[:, None, :, None].expand_as(t))

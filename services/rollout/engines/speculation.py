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


def hide_rejected(attn: torch.Tensor, kept: torch.Tensor, width: int) -> None:
    """In place: hide from attention the last `width` columns of each of the first rows (one
    per entry of `kept`, the rows fed `width` tokens this step) past the `kept` first (the
    positions of its rejected draft tokens, and padding)."""
    cols = torch.arange(width).unsqueeze(0)
    fed = attn[: len(kept), -width:]
    attn[: len(kept), -width:] = fed.masked_fill(cols >= kept.unsqueeze(1), 0)


def holes(attn: torch.Tensor) -> int:
    """How many columns wider the cache is than its longest row: the columns that compacting
    would drop (each row's hidden positions, where another row does not fill them)."""
    return attn.shape[1] - int(attn.sum(dim=1).max()) if attn.numel() else 0


def compact(layers: Any, attn: torch.Tensor) -> torch.Tensor:
    """Move each row's attended cache columns to the right end, in order, the hidden ones to
    the front (where `HFEngine._trim` drops those no row attends): one copy of the cache.
    `layers`' keys and values are replaced; the new attention mask is returned."""
    source = torch.sort(attn, dim=1, stable=True).indices  # hidden first, then attended in order
    for layer in layers:
        layer.keys = take_columns(layer.keys, source)
        layer.values = take_columns(layer.values, source)
    return attn.gather(1, source)


def take_columns(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`t` (rows x heads x columns x dim) with column c of row b taken from `source[b, c]`."""
    rows = torch.arange(t.shape[0], device=t.device).unsqueeze(1)
    return t.transpose(1, 2)[rows, source.to(t.device)].transpose(1, 2)

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


# what one more fed token per row costs, as a share of a plain step, by device: on CPU the
# wider pass is compute (32 rows of a 3-layer, 128-wide model, one thread: a 5-wide pass 1.66x a
# plain one, bench/long_tail.py); on a GPU decoding is memory-bound and a few more tokens per
# row cost little
COLUMN_COST = {"cpu": 0.165}
COLUMN_COST_ACCELERATOR = 0.03
MAX_PROBE_EVERY = 256  # steps between probes of a gate whose drafts keep missing, at most


@dataclass
class DraftGate:
    """Whether a decode step drafts at all: the tokens its drafts are expected to add against
    what feeding every row `width` tokens costs. A step of `rows` rows yields `rows` tokens
    plain; drafted, it yields `acceptance` of its draft tokens more, at `1 + column_cost *
    (width - 1)` the cost: it pays when the expected extra tokens per row pass `column_cost *
    (width - 1)`. `acceptance` is the moving share of drafted tokens kept; a step gated off
    still drafts after `interval` steps (a probe), so a run whose drafts start paying (a later
    epoch, siblings finishing) turns speculation back on; each probe that finds it still does
    not pay doubles the interval, up to `MAX_PROBE_EVERY` (short answers that never match cost
    a probe in hundreds of steps). Drafts the gate stops change how fast a step goes, never its
    tokens."""

    column_cost: float
    acceptance: float = 0.5  # a prior, moved by every drafted step
    weight: float = 0.2
    probe_every: int = 16
    interval: int = 16  # steps gated off before the next probe
    skipped: int = 0  # steps gated off since the last drafted one

    def drafts(self, drafted_tokens: int, rows: int, width: int) -> bool:
        gain = self.acceptance * drafted_tokens / max(1, rows)
        if gain > self.column_cost * (width - 1):
            self.skipped, self.interval = 0, self.probe_every
            return True
        if self.skipped >= self.interval:
            self.skipped, self.interval = 0, min(MAX_PROBE_EVERY, 2 * self.interval)
            return True
        self.skipped += 1
        return False

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.acceptance += self.weight * (accepted / drafted - self.acceptance)


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

"""How a step's responses become model inputs: cutting them into micro-batches (by sequence count,
or by a token budget) and laying a micro-batch out as model input, padded or packed. Pure tensor
and list code: no model, no I/O.

Padded: one row per sequence (prompt + response), right-padded to the longest, with an attention
mask. Packed: every sequence of the micro-batch in one row, no padding; each sequence's position
ids restart at 0, which is what keeps sequences apart (transformers' packed-sequence masks: no
2-D attention mask, no cache). Either way the layout says where, in the flattened [rows x width]
hidden states, the state that predicts each response token sits: `positions[i, j]` for response
i's token j, so that the LM head runs at those places only.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Row:
    """One response to train on."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # the rollout's, one per response token
    advantage: float  # centred reward, divided by its group's std under scale_rewards="group"

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch laid out for the model, and each response token's place in it."""

    input_ids: torch.Tensor  # [rows, width]
    attention_mask: torch.Tensor | None  # [rows, width] when padded; None when packed
    position_ids: torch.Tensor | None  # [1, width] when packed (restarting per sequence)
    positions: torch.Tensor  # [N, T] index into the flattened [rows x width] hidden states
    targets: torch.Tensor  # [N, T] the response tokens
    mask: torch.Tensor  # [N, T] 1 on response tokens, 0 on the padding of short responses
    old_logprobs: torch.Tensor  # [N, T] the rollout's logprobs

    @property
    def padding_tokens(self) -> int:
        """Model positions holding no token of a sequence."""
        if self.attention_mask is None:
            return 0
        return int(self.attention_mask.numel() - self.attention_mask.sum())


def cut_by_count(rows: list[Row], size: int, final: bool) -> tuple[list[list[Row]], list[Row]]:
    """Full micro-batches of `size` rows, and the rows left over (a last short micro-batch
    instead when `final`)."""
    full = len(rows) // size * size
    batches = [rows[start : start + size] for start in range(0, full, size)]
    rest = rows[full:]
    if final and rest:
        return [*batches, rest], []
    return batches, rest


def cut_by_tokens(rows: list[Row], budget: int, final: bool) -> tuple[list[list[Row]], list[Row]]:
    """Micro-batches of rows, in order, each holding at most `budget` tokens (a row longer than
    the budget alone makes one), and the rows left over for a micro-batch not full yet (a last
    one instead when `final`)."""
    batches: list[list[Row]] = []
    current: list[Row] = []
    used = 0
    for row in rows:
        if current and used + row.tokens > budget:
            batches.append(current)
            current, used = [], 0
        current.append(row)
        used += row.tokens
    if final and current:
        return [*batches, current], []
    return batches, current


def _response_tables(
    rows: list[Row], starts: Iterable[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """positions, targets, mask, old logprobs ([N, T], T the longest response), given where each
    row's sequence starts in the flattened layout."""
    n, width = len(rows), max(1, max(len(r.response_ids) for r in rows))
    positions = torch.zeros((n, width), dtype=torch.long)
    targets = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width))
    old = torch.zeros((n, width))
    for i, (r, start) in enumerate(zip(rows, starts, strict=True)):
        k = len(r.response_ids)
        # the state at position t predicts token t + 1: the response's first token is predicted
        # by the prompt's last position
        first = start + len(r.prompt_ids) - 1
        positions[i, :k] = torch.arange(first, first + k)
        targets[i, :k] = torch.tensor(r.response_ids)
        mask[i, :k] = 1
        old[i, :k] = torch.tensor(r.logprobs[:k])
    return positions, targets, mask, old


def padded(rows: list[Row], pad_id: int) -> MicroBatch:
    """One row per sequence, right-padded, with an attention mask."""
    width = max(r.tokens for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        seq = r.prompt_ids + r.response_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
    tables = _response_tables(rows, (i * width for i in range(len(rows))))
    return MicroBatch(ids, attn, None, *tables)


def packed(rows: list[Row]) -> MicroBatch:
    """Every sequence in one row, no padding, position ids restarting at each sequence."""
    starts: list[int] = []
    ids: list[int] = []
    pos: list[int] = []
    for r in rows:
        starts.append(len(ids))
        ids.extend(r.prompt_ids + r.response_ids)
        pos.extend(range(r.tokens))
    tables = _response_tables(rows, starts)
    return MicroBatch(torch.tensor([ids]), None, torch.tensor([pos]), *tables)

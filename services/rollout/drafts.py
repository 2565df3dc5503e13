"""Draft tokens for speculative decoding, matched from a request's history.

A request of a GRPO group often writes what was written before: its finished siblings' tokens,
earlier responses to the same prompt, pieces of the prompt itself (RhymeRL's HistoSpec, Seer's
grouped speculation). `DraftIndex` holds a bounded set of such reference sequences, indexed once
when built, and `propose` returns the tokens that followed the longest suffix of a request's
context found in them (up to `max_ngram` tokens long; among equally long matches the latest,
the references being given oldest first). The engine verifies a draft exactly against its own
seeded draws (engines/hf.py): a wrong draft costs a wider forward pass, never a different token.

Bounded: at most `MAX_REFERENCES` references and `MAX_REFERENCE_TOKENS` tokens in all are
indexed (the latest kept where more are given), and a call looks at no more than
`MAX_CANDIDATES` occurrences of the context's last token, so it stays cheap on any input.

Pure: no torch, no I/O.
"""

from collections.abc import Sequence

from services.contracts.messages import MAX_DRAFT_REFERENCES, MAX_DRAFT_TOKENS
from services.core.request_table import latest_within

MAX_REFERENCES = MAX_DRAFT_REFERENCES + 1  # a job's drafts and its prompt
MAX_REFERENCE_TOKENS = 2 * MAX_DRAFT_TOKENS
MAX_NGRAM = 8
MAX_CANDIDATES = 64  # occurrences of the context's last token looked at per call, latest first


class DraftIndex:
    """Reference token sequences, indexed by token: each token -> where it occurs with at least
    one token after it, as (reference, position), latest last."""

    def __init__(self, references: Sequence[Sequence[int]], max_ngram: int = MAX_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, not {max_ngram}")
        self.max_ngram = max_ngram
        self.references = latest_within(references, MAX_REFERENCES, MAX_REFERENCE_TOKENS)
        self._at: dict[int, list[tuple[int, int]]] = {}
        for r, ref in enumerate(self.references):
            for pos in range(len(ref) - 1):
                self._at.setdefault(ref[pos], []).append((r, pos))

    def __bool__(self) -> bool:
        return bool(self._at)

    def propose(self, context: Sequence[int], k: int, position: int | None = None) -> list[int]:
        """Up to `k` tokens that followed the longest suffix of `context` (at most `max_ngram`
        tokens) found in a reference; [] when its last token occurs in none. Among equally long
        matches, the one whose draft starts nearest `position` in its reference (the response
        position of the next token: a sibling's or an earlier response's structure tends to
        line up with the request's, and a run of one token matches all along itself), then the
        latest."""
        if k < 1 or not context:
            return []
        candidates = self._at.get(context[-1])
        if not candidates:
            return []
        best, best_score = candidates[-1], (0, 0)
        for r, pos in reversed(candidates[-MAX_CANDIDATES:]):
            n = self._match_length(context, self.references[r], pos)
            off = 0 if position is None else -abs(pos + 1 - position)
            if (n, off) > best_score:
                best, best_score = (r, pos), (n, off)
                if best_score == (self.max_ngram, 0):
                    break
        r, pos = best
        return list(self.references[r][pos + 1 : pos + 1 + k])

    def _match_length(self, context: Sequence[int], ref: Sequence[int], pos: int) -> int:
        """How many tokens, up to `max_ngram`, `context` and `ref[: pos + 1]` end with alike."""
        n = 1
        limit = min(self.max_ngram, len(context), pos + 1)
        while n < limit and context[-1 - n] == ref[pos - n]:
            n += 1
        return n

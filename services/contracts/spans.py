"""Spans of a response's tokens, as (offset, length) pairs: which tokens of a multi-turn response
the model did not generate (the environment's observations: tool results, feedback), as
`Response.observed` carries them. Pure list code: checks spans against a response's length and
turns them into the per-token mask the trainer trains through. It does not say where the spans
come from (the coordinator's multi-turn requests do).
"""

from collections.abc import Sequence

Span = tuple[int, int]  # (offset, length) of a run of tokens in a response


class InvalidSpans(ValueError):
    """Spans that are out of order, overlapping, empty or past the response's end."""


def span_error(spans: Sequence[Span], length: int) -> str | None:
    """Why `spans` do not fit a response of `length` tokens (None: they do). Valid spans are
    non-empty, in bounds, in order and not overlapping (adjacent spans are allowed)."""
    end = 0  # where the previous span ends
    for i, (offset, n) in enumerate(spans):
        if n < 1:
            return f"span {i} ({offset}, {n}) is empty"
        if offset < end:
            return f"span {i} ({offset}, {n}) starts before {end}, the end of the one before it"
        if offset + n > length:
            return f"span {i} ({offset}, {n}) ends past the response's {length} tokens"
        end = offset + n
    return None


def generated_mask(spans: Sequence[Span], length: int) -> list[bool] | None:
    """Per token of a response of `length` tokens whose observation tokens are `spans`: True
    where the model generated it. None when there is no span (every token generated)."""
    error = span_error(spans, length)
    if error is not None:
        raise InvalidSpans(error)
    if not spans:
        return None
    out = [True] * length
    for offset, n in spans:
        out[offset : offset + n] = [False] * n
    return out


def generated_count(spans: Sequence[Span], length: int) -> int:
    """How many of a response's `length` tokens the model generated (spans already checked)."""
    return length - sum(n for _, n in spans)

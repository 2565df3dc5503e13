"""The record a coordinator read appends to its step's log (`keys.step_log`): for each request
the read changed, its new tokens, their logprobs and its new version runs, from the offsets
where they begin. One record per read per step, whatever the number of requests, so that Redis
pays one append per read rather than two or three per request; replaying the records in order
gives back every request's arrays (`replay`). Pure: no Redis.

A record is little-endian: a uint32 count n, then n heads of six uint32 (prompt index, sample
index, token offset, new tokens k, version-run offset, new runs m), then each entry's data in
the same order: k int32 tokens, k float64 logprobs, m (offset, version) int32 pairs. An entry
whose offsets are below what the request holds cuts it there first (a response restarted from
zero, migration off, is an entry at offset 0).
"""

import sys
from array import array
from dataclasses import dataclass, field

HEAD_FIELDS = 6
_BIG = sys.byteorder == "big"


@dataclass
class Arrays:
    """A request's arrays as the log replays them."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_runs: list[tuple[int, int]] = field(default_factory=list)


class RecordWriter:
    """The entries of one record, appended one request at a time."""

    def __init__(self) -> None:
        self.heads = array("I")
        self.parts: list[bytes] = []

    def __len__(self) -> int:
        return len(self.heads) // HEAD_FIELDS

    def add(
        self,
        prompt: int,
        sample: int,
        offset: int,
        tokens: list[int],
        logprobs: list[float],
        run_offset: int,
        runs: list[tuple[int, int]],
    ) -> None:
        self.heads.extend((prompt, sample, offset, len(tokens), run_offset, len(runs)))
        token_part, logprob_part = array("i", tokens), array("d", logprobs)
        run_part = array("i", [x for run in runs for x in run])
        if _BIG:
            for part in (token_part, logprob_part, run_part):
                part.byteswap()
        self.parts += (token_part.tobytes(), logprob_part.tobytes(), run_part.tobytes())

    def record(self) -> bytes:
        heads = self.heads
        if _BIG:
            heads = array("I", heads)
            heads.byteswap()
        count = array("I", [len(self)])
        if _BIG:
            count.byteswap()
        return count.tobytes() + heads.tobytes() + b"".join(self.parts)


def _read(kind: str, data: memoryview, at: int, n: int) -> tuple[array, int]:
    out = array(kind)
    end = at + n * out.itemsize
    out.frombytes(data[at:end])
    if _BIG:
        out.byteswap()
    return out, end


def replay(records: list[bytes], into: dict[tuple[int, int], Arrays] | None = None):
    """Apply `records` in order to the arrays of each (prompt, sample); the arrays."""
    out = {} if into is None else into
    for record in records:
        data = memoryview(record)
        (n,), at = _read("I", data, 0, 1)
        heads, at = _read("I", data, at, n * HEAD_FIELDS)
        for i in range(n):
            prompt, sample, offset, k, run_offset, m = heads[HEAD_FIELDS * i : HEAD_FIELDS * i + 6]
            arrays = out.get((prompt, sample))
            if arrays is None:
                arrays = out[(prompt, sample)] = Arrays()
            if offset > len(arrays.token_ids) or run_offset > len(arrays.version_runs):
                raise ValueError(f"a step log entry of {prompt}:{sample} leaves a gap")
            tokens, at = _read("i", data, at, k)
            logprobs, at = _read("d", data, at, k)
            runs, at = _read("i", data, at, 2 * m)
            del arrays.token_ids[offset:], arrays.logprobs[offset:]
            arrays.token_ids += tokens.tolist()
            arrays.logprobs += logprobs.tolist()
            del arrays.version_runs[run_offset:]
            flat = runs.tolist()
            arrays.version_runs += list(zip(flat[::2], flat[1::2], strict=True))
        if at != len(record):
            raise ValueError(f"a step log record of {len(record)} bytes holds {at}")
    return out

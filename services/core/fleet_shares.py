"""Fleet shares: how many of the fleet's rollout slots each active run may hold now, when several
runs share one pool (issue 52), as a pure policy.

A run's claim is its weight (`share`, default 1), the slots its unfinished requests could fill
(`wanted`: queued plus executing) and whether its oldest step waits only on its last requests
(`tail`). The fleet's slots go out by weighted max-min fairness (water-filling):

1. A run in its tail comes first and gets what it wants: a synchronous step that waits on a few
   last requests holds its trainer idle, and a few slots end that wait. Tails that want more
   than the fleet has share it by weight among themselves.
2. The slots left are filled by weight among the other runs. A run that wants less than its
   weighted part gets what it wants, and what it leaves is split among the rest by weight, until
   every run either has all it wants or its exact part of what remains.
3. Parts are whole slots: each run gets the floor of its part, and the slots left over go to the
   largest fractions (ties to the run listed first), never past what a run wants.

A run with nothing waiting gets nothing and takes nothing from the others: the fleet is never
held idle for a share no one uses. The allotment says how many slots; which worker holds them
is the read caps' and the balancer's (`balancer.read_cap`, `balancer.releases`), per run.

`share_error` is the measure of how well a fleet kept to the allotments over a window: the
largest gap, over runs, between the fraction of the slots a run was allotted and the fraction
it used.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class ClaimError(ValueError):
    """A claim no allotment can be made for (its share not positive, its demand negative, a
    run named twice)."""


@dataclass(frozen=True)
class RunClaim:
    run_id: str
    share: float  # the run's weight among the runs with work waiting (> 0)
    wanted: int  # slots its unfinished requests could fill now: queued plus executing (>= 0)
    tail: bool = False  # its oldest step waits only on its last requests


def allot(capacity: int, claims: Sequence[RunClaim]) -> dict[str, int]:
    """Whole slots of the fleet's `capacity` for each claim's run (every run listed, 0 where it
    gets none); the sum is min(capacity, total wanted)."""
    _check(capacity, claims)
    parts = {c.run_id: 0.0 for c in claims}
    tails = [c for c in claims if c.tail and c.wanted > 0]
    left = float(capacity)
    for group in (tails, [c for c in claims if not c.tail and c.wanted > 0]):
        filled = _water_fill(left, group)
        parts.update(filled)
        left -= sum(filled.values())
    return _whole_slots(capacity, claims, parts)


def share_error(allotted: Mapping[str, float], used: Mapping[str, float]) -> float:
    """The largest gap, over the runs in either, between a run's fraction of the slots allotted
    and its fraction of the slots used (slot-seconds, say) over the same window; 0 for a window
    in which nothing was allotted or used."""
    total_a, total_u = sum(allotted.values()), sum(used.values())
    runs = set(allotted) | set(used)
    if not runs or (total_a <= 0 and total_u <= 0):
        return 0.0

    def frac(part: Mapping[str, float], total: float, run: str) -> float:
        return part.get(run, 0.0) / total if total > 0 else 0.0

    return max(abs(frac(allotted, total_a, r) - frac(used, total_u, r)) for r in runs)


def _check(capacity: int, claims: Sequence[RunClaim]) -> None:
    if capacity < 0:
        raise ClaimError(f"capacity must be >= 0, not {capacity}")
    seen: set[str] = set()
    for c in claims:
        if not (c.share > 0 and math.isfinite(c.share)):
            raise ClaimError(f"run {c.run_id}: share must be a positive number, not {c.share}")
        if c.wanted < 0:
            raise ClaimError(f"run {c.run_id}: wanted must be >= 0, not {c.wanted}")
        if c.run_id in seen:
            raise ClaimError(f"run {c.run_id} claims twice")
        seen.add(c.run_id)


def _water_fill(capacity: float, claims: Sequence[RunClaim]) -> dict[str, float]:
    """Weighted max-min fair parts of `capacity` (fractional): a claim gets min(wanted, its
    weighted part of what the claims not yet satisfied leave)."""
    parts: dict[str, float] = {}
    open_claims = list(claims)
    left = max(0.0, capacity)
    while open_claims and left > 0:
        weight = sum(c.share for c in open_claims)
        level = left / weight  # slots per unit of share this round
        satisfied = [c for c in open_claims if c.wanted <= c.share * level]
        if not satisfied:
            for c in open_claims:
                parts[c.run_id] = c.share * level
            return parts
        for c in satisfied:
            parts[c.run_id] = float(c.wanted)
            left -= c.wanted
        open_claims = [c for c in open_claims if c.run_id not in parts]
    for c in open_claims:  # nothing left for them
        parts[c.run_id] = 0.0
    return parts


def _whole_slots(
    capacity: int, claims: Sequence[RunClaim], parts: Mapping[str, float]
) -> dict[str, int]:
    """`parts` in whole slots: floors, then the leftover slots to the largest fractions (ties
    to the claim listed first), never past a claim's `wanted`."""
    # a part within a rounding error of a whole number is that number
    whole = {c.run_id: math.floor(parts[c.run_id] + 1e-9) for c in claims}
    spare = min(capacity, sum(c.wanted for c in claims)) - sum(whole.values())
    order = sorted(
        (c for c in claims if whole[c.run_id] < c.wanted),
        key=lambda c: -(parts[c.run_id] - whole[c.run_id]),
    )
    for c in order:
        if spare <= 0:
            break
        whole[c.run_id] += 1
        spare -= 1
    return whole

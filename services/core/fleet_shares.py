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

An engine holds one model: a base model serves every LoRA run over it at once (each request
under its run's adapter), a full-weight run's model serves that run only. `place` says which
model each worker should hold so that every model gets the slots its runs were allotted: a
worker stays on what it holds while its model still needs slots, and a worker whose model has
more than it needs switches to one short of at least half a worker (a switch is a load of
seconds to minutes: never made for a slot or two), or of any slot where the deployment says
its loads take a moment (`switch_share`). A worker holding nothing loads whatever
is short, and is placed first. Placement never moves a worker to a model that would then
have more than it needs by a whole worker.

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


TAIL_SHARE = 0.1  # a step whose unfinished requests are this share of it or fewer is in its tail


def in_tail(unfinished: int, step_requests: int) -> bool:
    """Whether a step with `unfinished` of its `step_requests` requests left waits only on its
    last ones."""
    return 0 < unfinished <= max(1, math.floor(TAIL_SHARE * step_requests))


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


def worker_part(allotted: int, fleet_slots: int, worker_slots: int, floor: float = 0.0) -> int:
    """A worker's part of a run's `allotted` slots where it serves several runs at once: the
    run's share of the fleet's slots, of the worker's own (rounded up, so that the workers'
    parts cover the allotment), and never under `floor` of them (the run's weight among the
    runs the worker serves: its part while the allotment has not caught up with a step that
    just opened)."""
    if fleet_slots <= 0:
        return worker_slots
    part = max(math.ceil(allotted * worker_slots / fleet_slots), math.floor(floor * worker_slots))
    return min(worker_slots, part)


@dataclass(frozen=True)
class FleetWorker:
    worker_id: str
    slots: int  # requests its engine holds at once
    holds: str | None  # the model its engine holds now (None: none yet)


def place(
    workers: Sequence[FleetWorker], need: Mapping[str, int], switch_share: float = 0.5
) -> dict[str, str | None]:
    """The model each worker should hold, given the slots each model `need`s (the sum of its
    runs' allotments). Workers stay where they are needed; the fewest switches fill what is
    short; a loaded worker its model does not need switches to a model short by at least
    `switch_share` of its slots (0: by any, where loads take a moment); a worker no model
    needs keeps what it holds (None: nothing), and idles."""
    if not 0 <= switch_share <= 1:
        raise ClaimError(f"switch_share must be within 0..1, not {switch_share}")
    short = dict(need)
    placed: dict[str, str | None] = {}
    # those that stay: the largest first, while their model still needs slots
    for w in sorted(workers, key=lambda w: (-w.slots, w.worker_id)):
        if w.holds is not None and short.get(w.holds, 0) > 0:
            placed[w.worker_id] = w.holds
            short[w.holds] -= w.slots
    # the rest: each to the model shortest of slots, if it is short by switch_share of a worker
    free = sorted(
        (w for w in workers if w.worker_id not in placed),
        key=lambda w: (w.holds is not None, -w.slots, w.worker_id),  # empty engines first
    )
    for w in free:
        model = max(sorted(short), key=lambda m: short[m], default=None)
        # an empty engine loads whatever is short; a loaded one switches for switch_share
        worth = (
            model is not None
            and short[model] > 0
            and (w.holds is None or short[model] >= switch_share * w.slots)
        )
        if model is not None and worth:
            placed[w.worker_id] = model
            short[model] -= w.slots
        else:  # nothing short enough: it keeps what it holds, idle for now
            placed[w.worker_id] = w.holds
    return placed


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

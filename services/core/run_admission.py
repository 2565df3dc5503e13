"""Which queued run becomes active next: the run scheduler's one decision, under the
deployment's limit (`max_active_runs`, and a trainer idle for every run past the first) and
each token's (`TokenLimits`: the most active runs and the most summed share one submitting
token may hold). Pure: `state.runs.RunStore.activate_next` reads the queue and carries it out.

The queue stays first in, first out among the runs it admits: a run whose token is at its
limit waits, and the runs of other tokens behind it go first (it does not hold them up).
"""

from dataclasses import dataclass

SHARE_SLACK = 1e-9  # summed shares are floats: 0.1 + 0.2 may sum above 0.3


@dataclass(frozen=True)
class TokenLimits:
    """What one submitting token may hold active at once; 0: no limit."""

    runs: int = 0
    share: float = 0.0

    def __post_init__(self) -> None:
        if self.runs < 0 or self.share < 0:
            raise ValueError("per-token limits are >= 0 (0: no limit)")

    @property
    def any(self) -> bool:
        return bool(self.runs or self.share)


@dataclass(frozen=True)
class Held:
    """A run, queued or active: the token it came with (`RunRecord.owner`) and its share."""

    run_id: str
    owner: str
    share: float


def next_to_activate(
    queued: list[Held],
    active: list[Held],
    max_active: int,
    idle_trainers: int,
    per_token: TokenLimits,
) -> str | None:
    """The first queued run (oldest first) that may become active now; None while `max_active`
    runs are active, while one is and no trainer is idle to take another, or while no queued
    run's token has room left."""
    if not room_for_another(len(active), max_active, idle_trainers):
        return None
    for run in queued:
        if token_room(run, active, per_token):
            return run.run_id
    return None


def room_for_another(active: int, max_active: int, idle_trainers: int) -> bool:
    """Whether the deployment may make one more run active: under `max_active`, and with a
    trainer idle for it where a run is active already."""
    return active < max_active and (active == 0 or idle_trainers > 0)


def token_room(run: Held, active: list[Held], per_token: TokenLimits) -> bool:
    """Whether `run`'s token may hold it active beside what it holds active now."""
    mine = [held for held in active if held.owner == run.owner]
    if per_token.runs and len(mine) >= per_token.runs:
        return False
    summed = sum(held.share for held in mine) + run.share
    return not per_token.share or summed <= per_token.share + SHARE_SLACK


def share_refusal(share: float, per_token: TokenLimits) -> str | None:
    """Why a run of this share can never become active (its share alone is above the
    per-token limit), or None."""
    if per_token.share and share > per_token.share + SHARE_SLACK:
        return (
            f"rollout.share {share:g} is above the most one token may hold active "
            f"(max_share_per_token {per_token.share:g})"
        )
    return None

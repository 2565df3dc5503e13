"""When a run cannot progress, and which request is poison: pure policies (worker views, crash
counts and a clock in, decisions out). No Redis, no HTTP: the step controller
(`core.step_controller`) checks for a stall in its tick, and its shell writes what changes.

A step needs a rollout worker able to serve its weight version: one whose heartbeat is fresh,
that has not crashed, and that has not stepped aside for training (a paused reserved worker).
A worker still loading the version counts: it is coming. When no worker has been able for
`stall_after_s`, the run is stalled, with a reason that says what is wrong; as soon as one is
able again, it runs again. Stalled for `timeout_s`, the run fails with that reason. While the run
waits for the trainer no worker is needed, and the shell does not ask.

A request that was running when a worker crashed is a suspect: it runs alone from then on, so
a crash it causes again is its own. It is poison once it has crashed `max_crashes` workers and
the last crash was its own (it ran alone): bystanders of a crash are never quarantined.
"""

from dataclasses import dataclass
from enum import Enum

NAMES_SHOWN = 3  # workers named in a reason; the rest are counted
ERROR_CHARS = 300  # of a worker's error quoted in a reason


@dataclass(frozen=True)
class WorkerView:
    """An alive worker, from its heartbeat."""

    worker_id: str
    version: int | None
    # stepped aside (paused) holding a version that may generate the step: it does not serve it
    # (`step_controller.serves`, the one definition, decides it)
    paused: bool = False
    error: str = ""  # a task of it died of this: it is shutting down


@dataclass(frozen=True)
class GoneWorker:
    """A worker seen on the run whose heartbeat is gone."""

    worker_id: str
    how: str  # "lost" (heartbeat expired), "left" (preemption notice) or "crashed"
    error: str = ""  # its crash report's error, if any


@dataclass(frozen=True)
class Blocker:
    """Why a step cannot progress: a headline and what lies behind it."""

    headline: str
    detail: str = ""


def _names(ids: list[str]) -> str:
    shown = ", ".join(ids[:NAMES_SHOWN])
    return shown + (f" and {len(ids) - NAMES_SHOWN} more" if len(ids) > NAMES_SHOWN else "")


def blocker(version: int, alive: list[WorkerView], gone: list[GoneWorker]) -> Blocker | None:
    """Why no worker can serve `version` now, or None when one can (or is loading it)."""
    crashed = [w for w in alive if w.error]
    aside = [w for w in alive if not w.error and w.paused]
    if len(crashed) + len(aside) < len(alive):
        return None
    parts = []
    if gone:
        listed = [f"{g.worker_id} {g.how}" for g in gone]
        parts.append(f"{len(gone)} left: {_names(listed)}")
    if crashed:
        parts.append(f"{len(crashed)} crashing: {_names([w.worker_id for w in crashed])}")
    if aside:
        ids = [w.worker_id for w in aside]
        parts.append(f"{len(aside)} reserved stepped aside for training: {_names(ids)}")
    errors = [(w.worker_id, w.error) for w in crashed] + [
        (g.worker_id, g.error) for g in gone if g.error
    ]
    if errors:
        worker_id, error = errors[-1]
        parts.append(f"last error: {worker_id}: {error[:ERROR_CHARS]}")
    if not alive and not gone:
        parts.append("no worker has joined the run")
    return Blocker(f"no live rollout worker able to serve version {version}", "; ".join(parts))


class Action(Enum):
    NONE = "none"
    STALL = "stall"  # the run becomes stalled with `reason`
    UPDATE = "update"  # still stalled, the reason changed
    RESUME = "resume"  # it can progress again
    FAIL = "fail"  # stalled past the timeout: the run fails with `reason`


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""


@dataclass
class StallTracker:
    """The stalled/running state of one run over time. `observe` takes the wall clock (so that
    a stall restored after a coordinator restart keeps its start) and the blocker, if any."""

    stall_after_s: float
    timeout_s: float | None = None
    blocked_since: float | None = None
    stalled_since: float | None = None
    reason: str = ""
    shown: Blocker | None = None  # the blocker the reason was made from

    def restore(self, stalled_since: float, reason: str) -> None:
        """The run was stalled before this tracker existed."""
        self.blocked_since = self.stalled_since = stalled_since
        self.reason = reason

    def observe(self, now: float, why: Blocker | None) -> Decision:
        if why is None:
            self.blocked_since = None
            if self.stalled_since is None:
                return Decision(Action.NONE)
            self.stalled_since, self.reason, self.shown = None, "", None
            return Decision(Action.RESUME)
        if self.blocked_since is None:
            self.blocked_since = now
        if self.stalled_since is None:
            if now - self.blocked_since < self.stall_after_s:
                return Decision(Action.NONE)
            self.stalled_since = now
            self._explain(now, why)
            return Decision(Action.STALL, self.reason)
        if self.timeout_s is not None and now - self.stalled_since >= self.timeout_s:
            return Decision(
                Action.FAIL, f"stalled for {self.timeout_s:g}s (stall_timeout_s): {self.reason}"
            )
        if why != self.shown:
            self._explain(now, why)
            return Decision(Action.UPDATE, self.reason)
        return Decision(Action.NONE)

    def _explain(self, now: float, why: Blocker) -> None:
        assert self.blocked_since is not None
        self.shown = why
        self.reason = f"{why.headline} for {now - self.blocked_since:.0f}s"
        if why.detail:
            self.reason += f" ({why.detail})"


def is_poison(crashed_workers: int, alone: bool, max_crashes: int) -> bool:
    """A request is poison once it crashed `max_crashes` workers, the last while running alone
    (a crash with others beside it could be theirs)."""
    return alone and crashed_workers >= max_crashes

"""Trace replay: start and kill rollout workers so that their number follows a spot
availability trace (CSV `seconds,available`, as in ../shared/traces), compressed in time.

The trace says how many instances the cloud offers. Given `wanted` (the coordinator's
`preemptible_wanted` for the run), the replay is also the scaler: it holds no more workers than
that (`held`), handing the surplus back with SIGTERM (the worker releases its requests, which
migrate) and starting workers again when more are wanted and offered.

The schedule is pure (`services.infra.traces`, `held` and `plan`); `ChaosRunner` is the thin
shell that applies it to a deployment, sending SIGTERM (the preemption notice, with the worker's
grace period) to some victims and SIGKILL (no notice) to the others.
"""

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.infra.settings import settings_env
from services.infra.traces import load_trace, worker_targets
from services.rollout.settings import RolloutSettings

log = logging.getLogger(__name__)
WANTED_POLL_S = 0.5  # how often the scaler looks at the coordinator's preemptible_wanted


@dataclass
class Change:
    start: int = 0
    sigterm: list[str] = field(default_factory=list)
    sigkill: list[str] = field(default_factory=list)


def held(offered: int, wanted: int | None) -> int:
    """Workers a scaler holds: what the cloud offers, and no more than the coordinator wants
    (None: it wants no limit yet)."""
    return offered if wanted is None else min(offered, wanted)


def plan(running: list[str], target: int, rng: random.Random, sigterm_fraction: float) -> Change:
    """What to do to go from `running` workers to `target`: start some, or pick victims."""
    if target >= len(running):
        return Change(start=target - len(running))
    victims = rng.sample(running, len(running) - target)
    change = Change()
    for name in victims:
        (change.sigterm if rng.random() < sigterm_fraction else change.sigkill).append(name)
    return change


@dataclass
class ChaosOptions:
    """How `spotrl up --trace` and `spotrl chaos` replay a trace."""

    trace: Path
    time_scale: float = 600.0
    max_workers: int | None = None  # None: as many as the up command's --preemptible
    hours: float | None = None
    start_s: float = 0.0
    sigterm_fraction: float = 0.5
    grace_s: float = 5.0
    heartbeat_ttl_s: float = 2.0
    follow_wanted: bool = True  # hold no more than the coordinator's preemptible_wanted

    def targets(self, default_max: int) -> list[tuple[float, int]]:
        max_workers = self.max_workers if self.max_workers is not None else default_max
        return worker_targets(
            load_trace(self.trace), self.time_scale, max_workers, self.hours, self.start_s
        )

    def worker_env(self) -> dict[str, str]:
        return settings_env(
            RolloutSettings,
            preempt_grace_s=self.grace_s,
            heartbeat_ttl_s=self.heartbeat_ttl_s,
            heartbeat_s=self.heartbeat_ttl_s / 4,
        )


class ChaosRunner:
    """Applies worker targets to a deployment from a background thread; with `wanted`, holds
    no more than it returns (the coordinator's preemptible_wanted, read by the caller)."""

    def __init__(
        self,
        deployment,
        targets: list[tuple[float, int]],
        sigterm_fraction: float,
        seed: int = 0,
        pool: str = "preemptible",
        wanted: Callable[[], int | None] | None = None,
    ) -> None:
        self.deployment = deployment
        self.targets = targets
        self.sigterm_fraction = sigterm_fraction
        self.rng = random.Random(seed)
        self.pool = pool
        self.wanted = wanted
        self.counts = {"started": 0, "sigterm": 0, "sigkill": 0, "scaled_in": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def running(self) -> list[str]:
        return [
            p.name for p in self.deployment.workers() if p.alive() and f"-{self.pool}-" in p.name
        ]

    def start(self) -> None:
        self._thread.start()

    def wait(self) -> None:
        """Until the schedule has been applied to its end."""
        while self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        began = time.monotonic()
        pending = list(self.targets)
        offered, holding = 0, None
        while pending or self.wanted is not None:
            now = time.monotonic() - began
            offer_changed = bool(pending and pending[0][0] <= now)
            while pending and pending[0][0] <= now:
                offered = pending.pop(0)[1]
            target = held(offered, self.wanted() if self.wanted is not None else None)
            if offer_changed or target != holding:
                # fewer wanted than held, the offer unchanged: a hand-back, not a preemption
                self.apply(target, scale_in=not offer_changed)
                holding = target
            next_s = pending[0][0] - now if pending else WANTED_POLL_S
            if self.wanted is not None:
                next_s = min(next_s, WANTED_POLL_S)
            if self._stop.wait(max(0.0, next_s)):
                return

    def apply(self, target: int, scale_in: bool = False) -> Change:
        """Go to `target` workers: start some, or stop some (with `scale_in`, every one with
        SIGTERM: handed back, not preempted)."""
        mix = 1.0 if scale_in else self.sigterm_fraction
        change = plan(self.running(), target, self.rng, mix)
        for name in change.sigterm:
            self.deployment.procs[name].preempt()
        for name in change.sigkill:
            self.deployment.procs[name].kill()
        for _ in range(change.start):
            self.deployment.add_worker(self.pool, wait=False)
        self.counts["started"] += change.start
        self.counts["sigterm"] += len(change.sigterm)
        self.counts["sigkill"] += len(change.sigkill)
        if scale_in:
            self.counts["scaled_in"] += len(change.sigterm)
        if change.start or change.sigterm or change.sigkill:
            log.info(
                "chaos: %s %d: started %d, SIGTERM %s, SIGKILL %s",
                "wanted" if scale_in else "target",
                target,
                change.start,
                change.sigterm,
                change.sigkill,
            )
        return change

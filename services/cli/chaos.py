"""Trace replay: start and kill rollout workers so that their number follows a spot
availability trace (CSV `seconds,available`, as in ../shared/traces), compressed in time.

The schedule is pure (`load_trace`, `worker_targets`, `plan`); `ChaosRunner` is the thin shell
that applies it to a deployment, sending SIGTERM (the preemption notice, with the worker's grace
period) to some victims and SIGKILL (no notice) to the others.
"""

import csv
import logging
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


class TraceError(ValueError):
    pass


@dataclass(frozen=True)
class TracePoint:
    seconds: float
    available: int


def load_trace(path: str | Path) -> list[TracePoint]:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace {path} does not exist")
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None or {"seconds", "available"} - set(reader.fieldnames):
            raise TraceError(f"{path}: header must be 'seconds,available'")
        points = []
        for line, row in enumerate(reader, start=2):
            try:
                point = TracePoint(float(row["seconds"]), int(float(row["available"])))
            except (TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{line}: {exc}") from exc
            if point.available < 0 or (points and point.seconds < points[-1].seconds):
                raise TraceError(f"{path}:{line}: times must not decrease, counts be >= 0")
            points.append(point)
    if not points:
        raise TraceError(f"{path}: no rows")
    return points


def worker_targets(
    trace: list[TracePoint],
    time_scale: float,
    max_workers: int,
    hours: float | None = None,
    start_s: float = 0.0,
) -> list[tuple[float, int]]:
    """(wall seconds from start, workers wanted) for the trace from `start_s` (trace seconds)
    on: trace time divided by `time_scale`, counts scaled so that the trace's largest fleet maps
    to `max_workers`. Instant changes (rows with the same time) collapse to their last value."""
    if time_scale <= 0 or max_workers < 0:
        raise TraceError("time_scale must be > 0 and max_workers >= 0")
    fleet = max(p.available for p in trace) or 1
    start = trace[0].seconds + start_s
    before = [p for p in trace if p.seconds <= start]
    points = [TracePoint(start, before[-1].available)] if before else []
    points += [p for p in trace if p.seconds > start]
    out: list[tuple[float, int]] = []
    for p in points:
        if hours is not None and p.seconds - start > hours * 3600:
            break
        at = (p.seconds - start) / time_scale
        target = round(p.available * max_workers / fleet)
        if out and out[-1][0] == at:
            out[-1] = (at, target)
        elif not out or out[-1][1] != target:
            out.append((at, target))
    return out


@dataclass
class Change:
    start: int = 0
    sigterm: list[str] = field(default_factory=list)
    sigkill: list[str] = field(default_factory=list)


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

    def targets(self, default_max: int) -> list[tuple[float, int]]:
        max_workers = self.max_workers if self.max_workers is not None else default_max
        return worker_targets(
            load_trace(self.trace), self.time_scale, max_workers, self.hours, self.start_s
        )

    def worker_env(self) -> dict[str, str]:
        return {
            "SPOTRL_PREEMPT_GRACE_S": str(self.grace_s),
            "SPOTRL_HEARTBEAT_TTL_S": str(self.heartbeat_ttl_s),
            "SPOTRL_HEARTBEAT_S": str(self.heartbeat_ttl_s / 4),
        }


class ChaosRunner:
    """Applies worker targets to a deployment from a background thread."""

    def __init__(
        self,
        deployment,
        targets: list[tuple[float, int]],
        sigterm_fraction: float,
        seed: int = 0,
        pool: str = "preemptible",
    ) -> None:
        self.deployment = deployment
        self.targets = targets
        self.sigterm_fraction = sigterm_fraction
        self.rng = random.Random(seed)
        self.pool = pool
        self.counts = {"started": 0, "sigterm": 0, "sigkill": 0}
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
        for at, target in self.targets:
            if self._stop.wait(max(0.0, at - (time.monotonic() - began))):
                return
            self.apply(target)

    def apply(self, target: int) -> Change:
        change = plan(self.running(), target, self.rng, self.sigterm_fraction)
        for name in change.sigterm:
            self.deployment.procs[name].popen.send_signal(signal.SIGTERM)
        for name in change.sigkill:
            self.deployment.procs[name].kill()
        for _ in range(change.start):
            self.deployment.add_worker(self.pool, wait=False)
        self.counts["started"] += change.start
        self.counts["sigterm"] += len(change.sigterm)
        self.counts["sigkill"] += len(change.sigkill)
        if change.start or change.sigterm or change.sigkill:
            log.info(
                "chaos: target %d: started %d, SIGTERM %s, SIGKILL %s",
                target,
                change.start,
                change.sigterm,
                change.sigkill,
            )
        return change

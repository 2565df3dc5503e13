"""Spot availability traces (CSV `seconds,available`, as in ../shared/traces): reading them and
turning them into worker-count targets over time. Pure; used by the trace replay (`spotrl chaos`,
`spotrl up --trace`) and by the simulator.
"""

import csv
from dataclasses import dataclass
from pathlib import Path


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
        points: list[TracePoint] = []
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

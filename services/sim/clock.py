"""Where a simulated run stands, shared by the simulation's components (simulation.py, the
fleet in instances.py, the requests in requests.py): the time in simulated seconds, the latest
committed weight version, and the events to come, in time order (ties in the order they were
scheduled)."""

import heapq
import itertools
import math


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.version = 0  # latest committed weights
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()

    def at(self, t: float, kind: str, payload: object = None) -> None:
        """An event of `kind` (the name its owner handles) at time `t`."""
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def next_event_s(self) -> float:
        return self._events[0][0] if self._events else math.inf

    def due(self) -> tuple[str, object] | None:
        """The next event due by now (removed), or None."""
        if not self._events or self._events[0][0] > self.now:
            return None
        _, _, kind, payload = heapq.heappop(self._events)
        return kind, payload

"""One simulated engine instance with continuous batching, advanced in continuous time.

Every running request gains one token per decode step, so all of them advance in lockstep: the
engine keeps one progress `level` (tokens per request since it started) and each request
remembers the level at which it joined and the level at which it will stop. The step time comes
from the engine profile at the current batch and mean context, and is re-read whenever the
simulator advances the engine (at least every few simulated seconds), so it follows the contexts
as they grow.

- A joining request first costs a prefill of its prompt plus collected prefix, during which the
  engine makes no decode progress (one prefill per join: a continuation moves no KV cache).
- When the running contexts exceed the KV capacity, only the share that fits runs at a time
  (vLLM preempts and recomputes the rest): every request slows by that share.
- `plateau` is the same online estimator the rollout worker runs, fed the same samples.
"""

import heapq
from dataclasses import dataclass

from services.core.plateau import PlateauEstimator
from services.sim.profile import EngineProfile


@dataclass
class Running:
    rid: str
    lease: int
    offset: int  # response tokens collected before this job
    context: int  # prompt + prefix tokens at join
    join_level: float
    stop_level: float  # join_level + tokens this job will generate


class SimEngine:
    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self.level = 0.0
        self.running: dict[str, Running] = {}
        self._stops: list[tuple[float, str, int]] = []  # (stop_level, rid, lease), lazy deletion
        self._context_base = 0.0  # sum over running of (context at join - join_level)
        self.stall_until = 0.0  # prefills in progress
        self.busy_s = 0.0  # time with at least one request running
        self.tokens = 0.0  # decode tokens produced (fractional while running)
        self.plateau = PlateauEstimator(max_batch=profile.max_seqs)

    @property
    def batch(self) -> int:
        return len(self.running)

    def context_sum(self) -> float:
        return self._context_base + self.batch * self.level

    def add(self, rid: str, lease: int, context: int, offset: int, tokens: int, now: float) -> None:
        """Start a job: `context` tokens to prefill, then `tokens` decode steps."""
        self.stall_until = max(self.stall_until, now) + self.profile.prefill_s(context)
        run = Running(rid, lease, offset, context, self.level, self.level + tokens)
        self.running[rid] = run
        self._context_base += context - self.level
        heapq.heappush(self._stops, (run.stop_level, rid, lease))

    def generated(self, rid: str) -> int:
        run = self.running[rid]
        return min(int(self.level - run.join_level + 1e-6), round(run.stop_level - run.join_level))

    def remove(self, rid: str) -> tuple[Running, int]:
        """Take a request off the engine; the job and the whole tokens it generated."""
        tokens = self.generated(rid)
        run = self.running.pop(rid)
        self._context_base -= run.context - run.join_level
        return run, tokens

    def rate(self) -> float:
        """Tokens per second of each running request."""
        b = self.batch
        if b == 0:
            return 0.0
        context = self.context_sum()
        share = min(1.0, self.profile.kv_capacity_tokens / context) if context > 0 else 1.0
        return share / self.profile.step_s(b * share, context / b)

    def next_stop_s(self, now: float) -> float:
        """Seconds until the next request stops, at the current rate."""
        while self._stops and not self._live(self._stops[0]):
            heapq.heappop(self._stops)
        if not self._stops:
            return float("inf")
        rate = self.rate()
        wait = max(0.0, self.stall_until - now)
        return wait + max(0.0, self._stops[0][0] - self.level) / rate

    def advance(self, now: float, until: float) -> None:
        if not self.running:
            return
        self.busy_s += until - now
        start = max(now, self.stall_until)
        if until <= start:
            return
        rate = self.rate()
        gained = rate * (until - start)
        self.level += gained
        self.tokens += gained * self.batch
        self.plateau.record(self.batch, round(gained * self.batch), until - start)

    def stopped(self) -> list[str]:
        """Requests that reached their stop level."""
        out = []
        while self._stops and self._stops[0][0] <= self.level + 1e-6:
            entry = heapq.heappop(self._stops)
            if self._live(entry):
                out.append(entry[1])
        return out

    def _live(self, entry: tuple[float, str, int]) -> bool:
        run = self.running.get(entry[1])
        return run is not None and run.lease == entry[2] and run.stop_level == entry[0]

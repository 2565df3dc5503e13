"""Whether a run's failing user code calls (its environment's `step()`, its reward) let it go
on: a pure policy, counts and the spec's threshold in, a verdict out. No Redis, no logging; the
step's leader (`coordinator/step/loop.py`, `Leadership.end`) judges every step with the whole
step's counts (all shards added up) and fails the run on a `failed` verdict; the read API and
`spotrl up` judge the run's totals to say `ok` or `degraded`.

The rule: a step in which more than `max_error_share` of one kind's calls failed fails the run
(the first step alone is enough: a step whose calls all fail trains on zero rewards only). A run
with failures that never crossed the threshold in any step is `degraded`, with its shares. The
threshold is judged per step, not over the run so far: a run that was healthy for a hundred
steps and then fails on every call trains on nothing from then on, and must stop at once, not
when the run's average crosses the line. Since every step stayed at or under the threshold,
the run's totals do too (a weighted mean), so both judgements agree.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

KINDS = ("environment", "reward")  # the user code a run calls: its environment, its reward
Health = Literal["ok", "degraded", "failed"]


@dataclass(frozen=True)
class CallCount:
    """One kind's calls (of a step, or of the run so far) and how many of them failed."""

    calls: int = 0
    failed: int = 0
    first: str = ""  # the first failure in short form: its error line, and where in user code

    @property
    def share(self) -> float:
        """Failed calls per call (0.0 with no calls)."""
        return self.failed / self.calls if self.calls else 0.0

    def add(self, other: "CallCount") -> "CallCount":
        return CallCount(
            self.calls + other.calls, self.failed + other.failed, self.first or other.first
        )

    def public(self) -> dict:
        """As the API and `spotrl up`'s summary show it (share rounded to 4 decimals)."""
        return {
            "calls": self.calls,
            "failed": self.failed,
            "share": round(self.share, 4),
            "first": self.first,
        }


@dataclass(frozen=True)
class Verdict:
    health: Health
    reason: str = ""  # why it failed, or what degraded it; "" when ok


def judge(counts: Mapping[str, CallCount], max_share: float, where: str) -> Verdict:
    """The verdict on `counts` (by kind, of KINDS) against `max_share`: failed when one kind's
    share is above it, degraded when any call failed, else ok. `where` names the counts in
    the reason ("in step 0", "over the run")."""
    failing = [kind for kind in KINDS if kind in counts and counts[kind].failed]
    over = [kind for kind in failing if counts[kind].share > max_share]
    if over:
        kind = over[0]
        return Verdict("failed", _told(kind, counts[kind], where, max_share))
    if failing:
        return Verdict("degraded", "; ".join(_told(k, counts[k], where) for k in failing))
    return Verdict("ok")


def _told(kind: str, count: CallCount, where: str, max_share: float | None = None) -> str:
    text = f"{kind} failed on {count.failed} of {count.calls} calls {where}"
    if max_share is not None:
        text += f" (more than faults.max_error_share {max_share:g})"
    if count.first:
        text += f": {count.first} (first traceback in the run's log)"
    return text


def run_health(steps: Sequence[Mapping[str, CallCount]], max_share: float) -> tuple[Verdict, dict]:
    """A run's verdict from its steps' counts (failed if one step was over `max_share`, else
    its totals' verdict), and its totals by kind as the API shows them."""
    totals = {kind: CallCount() for kind in KINDS}
    worst: Verdict | None = None
    for index, counts in enumerate(steps):
        for kind in KINDS:
            totals[kind] = totals[kind].add(counts.get(kind, CallCount()))
        verdict = judge(counts, max_share, f"in step {index}")
        if worst is None and verdict.health == "failed":
            worst = verdict
    verdict = worst or judge(totals, max_share, "over the run")
    return verdict, {kind: count.public() for kind, count in totals.items()}

"""The scaler's decision: how many preemptible rollout replicas to hold, given whether a run is
active, the coordinator's `preemptible_wanted`, the replicas running now, bounds and cooldowns.
Pure: no clock of its own, no engine, no HTTP; `services.cli.scale` is the shell that reads the
figure, calls `decide` and applies the target to Kubernetes, Swarm or Compose. The figures it
reads, and what 0 and null mean, are `services.contracts.fleet` (the coordinator publishes them).

No run at all is not "no figure": with no active run (the coordinator's `runs_active` is 0, or
the run followed has ended) the pool goes to its lower bound (`min_replicas`, reason "down: no
run"), since nothing would use it; a run that has no figure yet holds as below.

With no figure (null, or the gauge's 0: `contracts.fleet.known_figure`) the scaler keeps the
replicas it finds (`when_unknown="hold"`, the default: the operator's own count), or goes to the
upper bound (`"max"`: every instance the bounds allow, what the simulator and `spotrl up
--trace` do with no figure).

Cooldowns count from the scaler's last change of the replica count, in either direction: a
change up waits `up_cooldown_s` after it, a change down `down_cooldown_s` (shrinking hands back
instances whose 90 s boot was already paid, so it is usually the longer one). Bounds are applied
before the cooldown: a count outside them is brought inside, still after its cooldown.
"""

from dataclasses import dataclass
from typing import Literal

from services.contracts.fleet import known_figure

WhenUnknown = Literal["hold", "max"]

UP = "up"
DOWN = "down"
HOLD_STEADY = "hold: steady"  # the target is what runs
HOLD_COOLDOWN = "hold: cooldown"
HOLD_AT_MAX = "hold: at max"  # more are wanted than the upper bound allows
HOLD_AT_MIN = "hold: at min"  # fewer are wanted than the lower bound allows
HOLD_NO_FIGURE = "hold: no figure"  # no figure yet (null or 0): keep what runs
DOWN_NO_RUN = "down: no run"  # no run is active: down to the lower bound
HOLD_NO_RUN = "hold: no run"  # no run is active and the pool is at its lower bound
REASONS = (
    UP,
    DOWN,
    HOLD_STEADY,
    HOLD_COOLDOWN,
    HOLD_AT_MAX,
    HOLD_AT_MIN,
    HOLD_NO_FIGURE,
    DOWN_NO_RUN,
    HOLD_NO_RUN,
)

MAX_REPLICAS = 10_000  # an upper bound past any real pool: a typo's bound, not a policy


class BoundsError(ValueError):
    """Bounds or cooldowns that no decision can honour (min > max, a negative value)."""


@dataclass(frozen=True)
class ScalePolicy:
    min_replicas: int
    max_replicas: int
    up_cooldown_s: float = 60.0
    down_cooldown_s: float = 300.0
    when_unknown: WhenUnknown = "hold"

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise BoundsError(f"min replicas {self.min_replicas} < 0")
        if self.max_replicas > MAX_REPLICAS:
            raise BoundsError(f"max replicas {self.max_replicas} > {MAX_REPLICAS}")
        if self.min_replicas > self.max_replicas:
            raise BoundsError(f"min replicas {self.min_replicas} > max {self.max_replicas}")
        if self.up_cooldown_s < 0 or self.down_cooldown_s < 0:
            raise BoundsError("cooldowns must be >= 0 s")
        if self.when_unknown not in ("hold", "max"):
            raise BoundsError(f"when_unknown {self.when_unknown!r}: hold or max")

    def clamp(self, replicas: int) -> int:
        return min(self.max_replicas, max(self.min_replicas, replicas))


@dataclass(frozen=True)
class ScaleDecision:
    wanted: int | None  # the figure as read (None: none)
    current: int  # replicas the engine runs (its desired count)
    target: int  # replicas to hold after this decision (== current on every hold)
    reason: str  # one of REASONS
    cooldown_left_s: float = 0.0  # with "hold: cooldown": how long until it may change

    @property
    def changes(self) -> bool:
        return self.target != self.current


def decide(
    policy: ScalePolicy,
    wanted: int | None,
    current: int,
    last_change_s: float | None,
    now_s: float,
    run_active: bool = True,
) -> ScaleDecision:
    """The replicas to hold now. `last_change_s` is when this scaler last changed the count
    (None: never), on the same clock as `now_s`. `run_active` False: no run is active, and the
    pool goes to its lower bound whatever `wanted` says."""
    if current < 0:
        raise ValueError(f"current replicas {current} < 0")
    figure = known_figure(wanted) if run_active else None
    if not run_active:
        desired = policy.min_replicas
    elif figure is None:
        desired = policy.max_replicas if policy.when_unknown == "max" else current
    else:
        desired = figure
    target = policy.clamp(desired)

    def hold(reason: str, left_s: float = 0.0) -> ScaleDecision:
        return ScaleDecision(wanted, current, current, reason, left_s)

    if target == current:
        if not run_active:
            return hold(HOLD_NO_RUN)
        if figure is None and policy.when_unknown == "hold":
            return hold(HOLD_NO_FIGURE)
        if desired > policy.max_replicas:
            return hold(HOLD_AT_MAX)
        if desired < policy.min_replicas:
            return hold(HOLD_AT_MIN)
        return hold(HOLD_STEADY)
    cooldown_s = policy.up_cooldown_s if target > current else policy.down_cooldown_s
    if last_change_s is not None and now_s - last_change_s < cooldown_s:
        return hold(HOLD_COOLDOWN, cooldown_s - (now_s - last_change_s))
    if target > current:
        return ScaleDecision(wanted, current, target, UP)
    return ScaleDecision(wanted, current, target, DOWN if run_active else DOWN_NO_RUN)

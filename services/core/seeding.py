"""Adaptive rollout offload with seeding: the paper's Algorithm 1, as a pure policy.

At the start of a step the reserved workers generate for a window T_seed, then step aside; their
in-flight requests migrate to the preemptible pool as seeds. After each step:

    T_seed <- max(min, T_seed + (t_train_wait - wait_share * t_train_compute) / eta)

where t_train_wait is the trainer's idle time waiting for groups after the reserved pool stepped
aside and t_train_compute its busy time on the step. The value that worked is remembered per
preemptible-pool size; when the size changes to one seen before, the controller jumps straight
to it. With no preemptible worker the window is unbounded: the reserved pool does all of the
rollout.

The paper moves T_seed by (t_train_wait - t_remote_wait) / eta, t_remote_wait being the
preemptible pool's idle time at the step's end. That balances two idle times when training
starts after the whole rollout. Our trainer trains each group as it completes, so the pool's
wait at the end is mostly the training still queued when the last group came in: seeding does
not cause it and a shorter window does not remove it. The paper's rule then shrinks T_seed to 0
while the trainer still idles at the start of every step (in the simulator, with 4 spot
instances, the trainer waited 144 s a step at T_seed 0 and 29 s at 80 s, whose steps were 7%
shorter). What seeding buys is the trainer's wait: the reserved node generates instead of
idling. So the window grows while the trainer waits after it, and shrinks once the trainer no
longer waits (a window longer than that wait only delays training, second for second): it
settles where the trainer waits about `wait_share` of its compute time. How much too long a
window was the trainer's wait cannot say (it is 0 either way), so a step where the trainer
waited less than that also drops `backoff` of the window.
"""

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class SeedingController:
    t_seed_s: float = 2.0
    eta: float = 2.0
    wait_share: float = 0.05  # the trainer's wait after the window it settles at, per compute
    backoff: float = 0.1  # the share of the window dropped after a step the trainer hardly waited
    min_seed_s: float = 0.0
    max_seed_s: float = 3600.0
    memory: dict[int, float] = field(default_factory=dict)
    count: int | None = None

    def window_s(self, n_preemptible: int) -> float:
        """T_seed for a step starting with `n_preemptible` preemptible workers."""
        if n_preemptible != self.count and n_preemptible in self.memory:
            self.t_seed_s = self.memory[n_preemptible]
        self.count = n_preemptible
        return math.inf if n_preemptible == 0 else self.t_seed_s

    def update(self, n_preemptible: int, t_train_wait_s: float, t_train_compute_s: float) -> float:
        """Move T_seed toward a trainer that waits `wait_share` of its compute time after the
        window; remember it for this pool size."""
        if n_preemptible == 0:
            return self.t_seed_s
        target = self.wait_share * t_train_compute_s
        t_seed = self.t_seed_s + (t_train_wait_s - target) / self.eta
        if t_train_wait_s < target:  # the window was long enough, maybe far too long
            t_seed -= self.backoff * self.t_seed_s
        self.t_seed_s = min(self.max_seed_s, max(self.min_seed_s, t_seed))
        self.memory[n_preemptible] = self.t_seed_s
        self.count = n_preemptible
        return self.t_seed_s


def recommended_pool_size(
    t_remote_s: float, n_preemptible: int, t_seed_s: float, n_reserved: int, t_train_s: float
) -> float:
    """N_prem = (t_remote * n_prem + T_seed * N_resv) / t_train: the preemptible pool size past
    which more instances no longer shorten the step (the rollout work, in instance-seconds,
    spread over the training time)."""
    if t_train_s <= 0:
        return math.inf
    return (t_remote_s * n_preemptible + t_seed_s * n_reserved) / t_train_s


def pool_target(n_prem_recommended: float, headroom: float) -> int | None:
    """How many preemptible instances a scaler should hold: N_prem with `headroom` for the
    step's long tail and for the next preemption, rounded up, at least one. None while N_prem
    is unknown (no step trained yet): hold what the cloud gives. Past N_prem an instance only
    idles while the trainer works, so holding every instance the cloud offers buys no speed
    and costs money."""
    if math.isinf(n_prem_recommended) or math.isnan(n_prem_recommended):
        return None
    return max(1, math.ceil(n_prem_recommended * headroom))


POOL_WINDOW = 3  # steps whose N_prem the pool follows


@dataclass
class PoolSizer:
    """The pool a scaler should hold after each step (`preemptible_wanted`): `pool_target` of
    the mean N_prem of the last `window` steps. One step's N_prem moves with its response
    lengths; following it alone hands instances back and boots new ones (90 s of billed boot
    each) on noise."""

    headroom: float
    window: int = POOL_WINDOW
    recent: deque[float] = field(default_factory=deque)

    def after_step(self, n_prem_recommended: float) -> int | None:
        if not (math.isinf(n_prem_recommended) or math.isnan(n_prem_recommended)):
            self.recent.append(n_prem_recommended)
            while len(self.recent) > self.window:
                self.recent.popleft()
        if not self.recent:
            return None
        return pool_target(sum(self.recent) / len(self.recent), self.headroom)


@dataclass(frozen=True)
class StepTimes:
    """When a step's phases ended, on one clock, as the seeding controller needs them."""

    n_preemptible: int  # preemptible workers when the step started
    n_reserved: int
    started: float  # the step's jobs were queued
    seed_end: float | None  # the reserved pool stepped aside (None: it never did)
    rollout_end: float  # the last group was complete
    committed: float  # the trainer committed the next version
    train_compute_s: float  # the trainer's busy time on the step (no waits)
    train_wait_s: float  # the trainer's idle time waiting for groups after seeding


@dataclass(frozen=True)
class SeedingUpdate:
    t_remote_wait_s: float  # the preemptible pool idled this long at the step's end
    t_seed_next_s: float
    n_prem_recommended: float  # inf when the step gave no training time to divide by


def train_compute_s(train_s: float, train_wait_s: float, seed_wait_s: float) -> float:
    """The trainer's busy time on a step, from its wall time and its waits (at least 1 ms)."""
    return max(1e-3, train_s - train_wait_s - seed_wait_s)


def after_step(controller: SeedingController, t: StepTimes, adapt: bool = True) -> SeedingUpdate:
    """After the next version is committed: move T_seed (Algorithm 1, unless `adapt` is off or
    the step had no reserved worker: the trainer's wait then says nothing about seeding) and
    work out N_prem from what the step took."""
    t_remote_wait = t.committed - t.rollout_end
    remote_from = t.seed_end if t.seed_end is not None else t.started
    n_prem = recommended_pool_size(
        t.rollout_end - remote_from if t.n_preemptible else 0.0,
        t.n_preemptible,
        remote_from - t.started,  # the time the reserved pool seeded
        t.n_reserved,
        t.train_compute_s,
    )
    if adapt and t.n_reserved > 0:  # with no reserved worker there was nothing to seed with
        t_seed = controller.update(t.n_preemptible, t.train_wait_s, t.train_compute_s)
    else:
        t_seed = controller.t_seed_s
    return SeedingUpdate(t_remote_wait, t_seed, n_prem)


def recall(seeded_out: bool, n_preemptible: int, unfinished: int) -> bool:
    """Whether the reserved pool, which stepped aside, should resume the step: requests are
    left and no preemptible worker is alive to do them. The step then never waits for the cloud
    to give an instance back."""
    return seeded_out and unfinished > 0 and n_preemptible == 0


def seeding_over(
    now: float,
    seed_start: float | None,
    window_s: float,
    n_reserved: int,
    n_preemptible: int,
    alone: bool = False,
) -> bool:
    """Whether the reserved pool should step aside: it is gone, or its window (counted from
    when it first held the step's weights) is over and a preemptible pool can take over (with
    none, stepping aside would leave the step with nobody to serve it; `alone`: it steps aside
    all the same, and the recall calls it back). The window ends at `seed_start + window_s`,
    the time a simulator's event for its end is due at."""
    if n_reserved == 0:
        return True
    over = seed_start is not None and now >= seed_start + window_s
    return over and (n_preemptible > 0 or alone)

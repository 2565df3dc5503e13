"""Continuous load balancing of executing requests: the paper's Algorithm 2, as a pure policy.

Pending work is not bound to any worker (it waits in the jobs stream, and a worker reads only as
many jobs as it has room for up to its plateau batch size), so only executing work needs moving:
when some worker is idle, nothing is queued, and another worker executes more than its plateau
batch size B_w, that worker is asked to release r = m_exec - B_w requests, which migrate.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    executing: int  # requests it holds now
    plateau: int  # batch size past which its throughput stops growing


def releases(loads: list[WorkerLoad], queued: int) -> dict[str, int]:
    """How many requests each overloaded worker should release; {} when balanced (none
    idle: a worker with none of the step's requests has room for them, not every slot taken by
    other runs' requests it serves at once)."""
    if queued > 0 or not any(w.executing == 0 and w.plateau > 0 for w in loads):
        return {}
    return {w.worker_id: w.executing - w.plateau for w in loads if w.executing > w.plateau}


def equal_caps(loads: list[WorkerLoad]) -> list[WorkerLoad]:
    """The loads with each cap lowered to an equal share of the executing requests: the balancer
    then evens the workers out, not only brings them under their plateaus."""
    share = fair_share(sum(w.executing for w in loads), len(loads))
    return [WorkerLoad(w.worker_id, w.executing, min(w.plateau, share)) for w in loads]


def fair_share(queued: int, workers: int) -> int:
    """The most jobs one of `workers` ready workers should read while `queued` wait: an equal
    split. Reading up to the plateau instead lets the first workers to poll take a whole step
    while later ones idle, and `releases` never moves requests below the plateau, so the long
    tail then stays on crowded engines."""
    return -(-queued // workers) if workers > 0 else 0


def read_cap(unfinished: int, serving: int) -> int:
    """The most requests of a step one worker should hold: an equal share of the step's
    unfinished requests (queued and executing) among the workers that serve its version or are
    loading it (alive, not stepped aside). Counting those still loading is what keeps the first
    workers to hold the weights (the reserved pool's, seconds ahead of a spot instance's pull)
    from taking the whole step, only for the balancer to move most of it again as each spot
    worker arrives. With no worker known yet, the first one to come may take what it can hold
    (the cap follows as others join)."""
    return fair_share(unfinished, max(1, serving))


RELEASE_COOLDOWN_S = 1.0  # the least time between two release orders to one worker


@dataclass
class ReleaseGate:
    """Lets a release order through to a worker at most once per `cooldown_s` (its previous
    release is still being flushed and re-queued meanwhile)."""

    cooldown_s: float = RELEASE_COOLDOWN_S
    last: dict[str, float] = field(default_factory=dict)  # worker -> when ordered

    def due(self, wanted: dict[str, int], now: float) -> tuple[dict[str, int], list[float]]:
        """The releases of `wanted` to order now, and when each one held back is due."""
        orders: dict[str, int] = {}
        held: list[float] = []
        for worker_id, count in wanted.items():
            last = self.last.get(worker_id)
            if last is not None and now - last < self.cooldown_s:
                held.append(last + self.cooldown_s)
                continue
            self.last[worker_id] = now
            orders[worker_id] = count
        return orders, held

"""How a rollout worker spends its grace period when told to leave (SIGTERM, or a cloud's
notice): pure arithmetic over a clock, no I/O; `services.rollout.app` carries it out.

The whole leaving fits in the grace period, whatever Redis or the engine do: the platform
kills the process at its end (Kubernetes, Swarm, a spot VM going away). In order:
1. stop the worker's tasks (no new job is read, the engine stops stepping);
2. release what it holds (flush, give back, acknowledge): most of the time, because it is what
   saves work; a release that cannot reach Redis gives up when its share ends;
3. the farewell: the leaving key, the heartbeat gone, withdrawal from its peers, Redis and the
   engine closed, each cut short at the end.
A little is kept back for what happens outside these steps: the server noticing the signal and
closing before the lifespan's shutdown starts, and the process exiting after it ends.
"""

from dataclasses import dataclass

# a cap, not a reservation: the tasks stop in milliseconds unless a decode step is running;
# releasing while one still runs could send its tokens twice
STOP_TASKS_SHARE, STOP_TASKS_MAX_S = 0.5, 5.0
FAREWELL_SHARE, FAREWELL_MAX_S = 0.2, 3.0
EXIT_SHARE, EXIT_MAX_S = 0.1, 1.0


@dataclass(frozen=True)
class LeavingPlan:
    """Deadlines, in the clock `plan_leaving` was given: each step ends by its own."""

    tasks_stopped_by: float
    released_by: float
    gone_by: float


def plan_leaving(grace_s: float, now: float) -> LeavingPlan:
    """Split `grace_s`, starting `now`, between the steps of leaving (see the module)."""
    if grace_s <= 0:
        raise ValueError(f"grace_s must be positive, not {grace_s}")
    gone_by = now + grace_s - min(EXIT_SHARE * grace_s, EXIT_MAX_S)
    released_by = gone_by - min(FAREWELL_SHARE * grace_s, FAREWELL_MAX_S)
    tasks_stopped_by = now + min(STOP_TASKS_SHARE * grace_s, STOP_TASKS_MAX_S)
    return LeavingPlan(tasks_stopped_by, released_by, gone_by)

"""The systems the simulator compares, each a set of switches over one simulation.

- reserved-only: veRL-like co-location on the reserved node: it generates the whole step, then
  trains on it.
- reserved-x2: the same on two reserved nodes (twice the price; training scales by
  `Scenario.reserved_scaling` per doubling).
- disagg-bal: the reserved node only trains; rollout runs on a fixed pool of on-demand 2-GPU
  instances, sized so that rollout keeps pace with training (the paper's Disagg.BAL). It gets
  our trainer's micro-batch pipelining and balancing: the strongest fixed-pool baseline.
- hybrid: ours, as the services run it today: spot instances that follow the trace, seeding
  with adaptive T_seed, migration, continuous balancing (a worker reads jobs up to its plateau
  batch size), micro-batch pipelining.
- hybrid-fair: the same with fair reads, a change the simulator argues for: a worker reads at
  most an equal share of the queued jobs, and the balancer caps each worker at an equal share
  of the executing ones (not only at its plateau), so no instance idles while others crowd.
- hybrid-no-seeding: the reserved node never generates while a spot instance is up.
- hybrid-no-migration: a preempted response restarts from zero and executing work is never
  rebalanced (the seeding hand-off still migrates: without it there is no seeding to ablate).
"""

from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class SystemSpec:
    name: str
    reserved_nodes: int = 1
    pool: Literal["none", "trace", "fixed"] = "trace"  # where rollout instances come from
    fixed_instances: int = 0  # size of a fixed (on-demand) pool
    seeding: Literal["adaptive", "off", "colocated"] = "adaptive"
    migration: bool = True  # preempted responses continue from their collected tokens
    balancing: bool = True  # executing work is rebalanced (the paper's Algorithm 2)
    fair_reads: bool = False  # a worker reads at most an equal share of the queued jobs

    def sized(self, instances: int) -> "SystemSpec":
        return replace(self, fixed_instances=instances)


RESERVED_ONLY = SystemSpec("reserved-only", pool="none", seeding="colocated", balancing=False)
RESERVED_X2 = SystemSpec(
    "reserved-x2", reserved_nodes=2, pool="none", seeding="colocated", balancing=False
)
DISAGG_BAL = SystemSpec("disagg-bal", pool="fixed", seeding="off")
HYBRID = SystemSpec("hybrid")
HYBRID_FAIR = SystemSpec("hybrid-fair", fair_reads=True)
HYBRID_NO_SEEDING = SystemSpec("hybrid-no-seeding", seeding="off")
HYBRID_NO_MIGRATION = SystemSpec("hybrid-no-migration", migration=False, balancing=False)

SYSTEMS = (
    RESERVED_ONLY,
    RESERVED_X2,
    DISAGG_BAL,
    HYBRID,
    HYBRID_FAIR,
    HYBRID_NO_SEEDING,
    HYBRID_NO_MIGRATION,
)

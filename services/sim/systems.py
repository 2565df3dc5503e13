"""The systems the simulator compares, each a set of switches over one simulation.

- reserved-only: veRL-like co-location on the reserved node: it generates the whole step, then
  trains on it.
- reserved-x2: the same on two reserved nodes (twice the price; training scales by
  `Scenario.reserved_scaling` per doubling).
- disagg-bal: the reserved node only trains; rollout runs on a fixed pool of on-demand 2-GPU
  instances, sized so that rollout keeps pace with training (the paper's Disagg.BAL). It gets
  our trainer's micro-batch pipelining and balancing: the strongest fixed-pool baseline.
- hybrid: ours, as the services run it with `fair_reads = true`: spot instances on the trace,
  seeding with adaptive T_seed, migration, micro-batch pipelining, fair reads (a worker holds
  at most an equal share of the step's unfinished requests among the workers serving or loading
  its version: `core.balancer.read_cap`) and continuous balancing onto equal shares.
  It holds the pool the coordinator asks for (`preemptible_wanted`: the mean N_prem of the
  last 3 steps times `RunSpec.pool_headroom`), never more than the trace offers.
- hybrid-all-spot: the same holding every spot instance the trace offers. The ablations below
  hold every instance too, so that each differs from hybrid-all-spot in one thing only (with
  pool sizing on, a system that seeds less is told to hold more instances).
- hybrid-plateau-reads: with `fair_reads = false`: a worker reads jobs up to its plateau batch
  size and the balancer moves only what is over a plateau (Algorithm 2 as the paper states it;
  the services' policy before issue 18).
- hybrid-no-seeding: the reserved node never generates while a spot instance is up.
- hybrid-no-migration: a preempted response restarts from zero and executing work is never
  rebalanced (the seeding hand-off still migrates: without it there is no seeding to ablate).
"""

from dataclasses import dataclass, replace
from typing import Literal

from services.common.runspec import RunSpec


@dataclass(frozen=True)
class SystemSpec:
    name: str
    reserved_nodes: int = 1
    pool: Literal["none", "trace", "fixed"] = "trace"  # where rollout instances come from
    fixed_instances: int = 0  # size of a fixed (on-demand) pool
    seeding: Literal["adaptive", "off", "colocated"] = "adaptive"
    migration: bool = True  # preempted responses continue from their collected tokens
    balancing: bool = True  # executing work is rebalanced (the paper's Algorithm 2)
    fair_reads: bool = True  # the read cap and equal-share balancing (RunSpec.fair_reads)
    # a trace pool follows the coordinator's `preemptible_wanted` (N_prem times this); None:
    # it holds every instance the cloud offers
    pool_headroom: float | None = RunSpec.model_fields["pool_headroom"].default

    def sized(self, instances: int) -> "SystemSpec":
        return replace(self, fixed_instances=instances)


RESERVED_ONLY = SystemSpec("reserved-only", pool="none", seeding="colocated", balancing=False)
RESERVED_X2 = SystemSpec(
    "reserved-x2", reserved_nodes=2, pool="none", seeding="colocated", balancing=False
)
DISAGG_BAL = SystemSpec("disagg-bal", pool="fixed", seeding="off")
HYBRID = SystemSpec("hybrid")
HYBRID_ALL_SPOT = SystemSpec("hybrid-all-spot", pool_headroom=None)
HYBRID_PLATEAU_READS = replace(HYBRID_ALL_SPOT, name="hybrid-plateau-reads", fair_reads=False)
HYBRID_NO_SEEDING = replace(HYBRID_ALL_SPOT, name="hybrid-no-seeding", seeding="off")
HYBRID_NO_MIGRATION = replace(
    HYBRID_ALL_SPOT, name="hybrid-no-migration", migration=False, balancing=False
)

SYSTEMS = (
    RESERVED_ONLY,
    RESERVED_X2,
    DISAGG_BAL,
    HYBRID,
    HYBRID_ALL_SPOT,
    HYBRID_PLATEAU_READS,
    HYBRID_NO_SEEDING,
    HYBRID_NO_MIGRATION,
)

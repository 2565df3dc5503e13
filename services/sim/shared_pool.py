"""Several RL runs on one trace (issue 52): one spot pool shared by K runs against K separate
deployments, with the same reserved nodes (one a run) and the same trace.

- separate: K deployments, each a plain `Simulation` of `ManyRuns.system` with its own
  reserved node and its own pool. The trace's spot instances are split evenly: of the n it
  offers, instance i goes to deployment i mod K, so deployment d holds ceil((n - d) / K)
  (`split_targets`).
- shared: K runs, each a `Simulation` with its own reserved node and weight store and no pool
  of its own, and one pool (`SharedPool`) that holds every instance the trace offers. An
  instance serves one run at a time. Every `place_every_s` the fleet is placed by the
  coordinator's own policy (`core.fleet_shares`, as `coordinator/workers/placement.py` calls
  it): each run claims its oldest step's unfinished requests (its tail flagged, share 1),
  `allot` splits the pool's slots (`ManyRuns.slots` an instance), `place` says which run each
  instance serves. An instance placed on another run gives back what it holds of the one it
  leaves (cause "balance", migrated; or with `leave="drain"` it first finishes them) and pulls
  the new run's weights: the switch cost is that whole pull (the model's bytes through the
  run's store and the instance's NIC, `Fleet.pull_s`, plus the load). With one run every
  instance serves it, as the services do, so K = 1 is the plain simulation. With
  `place_at_commit` the pool is also placed for a run's next step before it opens.

Both start every run at time 0 (together, not staggered); run r draws its workload with seed
`run_seed(seed, r)` in both, so the same runs are compared. The clocks of the K runs and the
pool's move in lockstep: each advances to the earliest time any of them needs (`SharedPool.run`
carries out `Simulation.run`'s loop body for each run).

What this leaves out: a placement order's delivery and a worker's reaction time (an order is
carried out at once), and placement while an instance pulls (it is placed once it is up).
"""

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from services.core.fleet_shares import FleetWorker, RunClaim, allot, in_tail, place
from services.sim.clock import Clock
from services.sim.engine import SimEngine
from services.sim.scenario import Scenario
from services.sim.simulation import QUANTUM_S, Simulation
from services.sim.state import Instance
from services.sim.systems import HYBRID_ALL_SPOT, SystemSpec
from services.sim.tail import verify_step


@dataclass(frozen=True)
class ManyRuns:
    """K runs on one trace: the system each run is, and how often the shared pool is placed."""

    runs: int = 4
    # every run holds every instance its pool offers (pool sizing off): the shared pool is the
    # trace's whole, and the separate pools its K parts
    system: SystemSpec = HYBRID_ALL_SPOT
    place_every_s: float = 1.0  # the coordinator's placement period (`FleetPlacer.every_s`)
    # the slots an instance tells placement it has: "max_seqs", its engine's cap (a worker's
    # heartbeat today: SPOTRL_SLOTS, vLLM max_num_seqs); "plateau", the batch its engine
    # measured its plateau at (`Instance.slots`, what the simulation's reads stop at); an int,
    # that many whatever the engine
    slots: Literal["max_seqs", "plateau"] | int = "max_seqs"
    # an instance placed on another run: "release", it gives back what it holds of the run it
    # leaves at once (the services' worker today); "drain", it reads no more of that run's
    # jobs (paused) and switches once its last request of it has ended
    leave: Literal["release", "drain"] = "release"
    # the pool is placed for a run's next step at its commit, before the step opens, so that
    # the step's seeding window (`Lead.window`, from the workers serving the run) counts the
    # workers placed on it; False: placement only every `place_every_s` (the services today:
    # a step opened while its run's workers serve others sees none, and its reserved node
    # generates the whole step)
    place_at_commit: bool = False

    def __post_init__(self) -> None:
        if self.runs < 1 or self.place_every_s <= 0:
            raise ValueError("runs must be >= 1 and place_every_s > 0")
        if isinstance(self.slots, int) and self.slots < 1:
            raise ValueError("slots must be >= 1")


def run_seed(seed: int, run: int) -> int:
    """The workload seed of run `run` (the same in both setups)."""
    return seed + 1000 * run


def split_targets(targets: list[tuple[float, int]], parts: int) -> list[list[tuple[float, int]]]:
    """The trace's counts split among `parts` deployments: instance i goes to deployment
    i mod parts, so deployment d holds ceil((n - d) / parts) of n."""
    return [[(t, (n - d + parts - 1) // parts) for t, n in targets] for d in range(parts)]


def run_separate(
    sc: Scenario, setup: ManyRuns, targets: list[tuple[float, int]], seed: int, horizon_s: float
) -> list[Simulation]:
    """K deployments, each with its part of the trace."""
    return [
        Simulation(sc, setup.system, part, run_seed(seed, d), horizon_s).run()
        for d, part in enumerate(split_targets(targets, setup.runs))
    ]


@dataclass
class PoolCounts:
    """What the shared pool did besides what each run's totals say."""

    switches: int = 0  # instances moved from one run to another
    switch_pull_s: float = 0.0  # the pulls those moves started, summed
    preempted_unplaced: int = 0  # instances taken back before they served any run


@dataclass
class SharedPool:
    """K runs over one pool of the trace's spot instances (see the module's docstring)."""

    sc: Scenario
    setup: ManyRuns
    targets: list[tuple[float, int]]
    seed: int
    horizon_s: float
    clock: Clock = field(default_factory=Clock)  # the pool's events: the trace, boots, placement
    counts: PoolCounts = field(default_factory=PoolCounts)

    def __post_init__(self) -> None:
        self.sims = [
            Simulation(self.sc, self.setup.system, [], run_seed(self.seed, r), self.horizon_s)
            for r in range(self.setup.runs)
        ]
        self.pool: dict[str, Instance] = {}  # every spot instance started, in order
        self.owner: dict[str, int] = {}  # instance -> the run it serves (absent: none yet)
        self.rng = random.Random(f"{self.seed}:victims")  # the cloud's choice, as `Fleet`'s
        for at, count in self.targets:
            self.clock.at(at, "target", count)
        self.opening: int | None = None  # the run whose next step is placed for now
        if self.setup.runs > 1:
            self.clock.at(0.0, "place")
            if self.setup.place_at_commit:
                for r, sim in enumerate(self.sims):
                    sim.handlers["committed"] = self.placed_first(r, sim.handlers["committed"])

    def placed_first(self, run: int, on_committed: Callable[[Any], None]) -> Callable[[Any], None]:
        """`on_committed` of run `run`, after placing the pool for its next step."""

        def committed(step: Any) -> None:
            # the version is in the store now (`on_committed` says so first): those placed
            # on the run pull it
            self.sims[run].clock.version = step + 1
            self.opening = run
            self.place_fleet()
            self.opening = None
            on_committed(step)

        return committed

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> "SharedPool":
        for sim in self.sims:
            sim.start_steps()
        while self.clock.now < self.horizon_s:
            t = min(self.clock.next_event_s(), self.horizon_s, *map(self.next_s, self.sims))
            if math.isinf(t):
                break
            for sim in self.sims:
                self.advance(sim, t)
            self.clock.now = t
            touched = self.handle_events()
            for r, sim in enumerate(self.sims):
                if (sim.handle_events() or r in touched) and not sim.system.max_staleness:
                    sim.tick()
                elif sim.system.max_staleness and sim.system.pool == "trace":
                    sim.recall_async()
                sim.requests.dispatch()
                sim.requests.balance()
        return self

    def next_s(self, sim: Simulation) -> float:
        """The earliest time `sim` needs to stop at: its next event, a request's end, or a
        quantum of its busy engines (`Simulation.run`)."""
        now = sim.clock.now
        busy = [i.engine for i in sim.fleet.instances.values() if i.engine.running]
        stops = (now + e.next_stop_s(now) for e in busy)
        quantum = now + QUANTUM_S if busy else math.inf
        return min(sim.clock.next_event_s(), quantum, *stops)

    def advance(self, sim: Simulation, t: float) -> None:
        """`sim`'s engines run to `t`; the requests that ended go to its flow."""
        sim.advance(t, [i for i in sim.fleet.instances.values() if i.engine.running])

    def handle_events(self) -> set[int]:
        """The pool's events due by now; the runs whose instances they changed."""
        touched: set[int] = set()
        while (event := self.clock.due()) is not None:
            kind, payload = event
            if kind == "target":
                assert isinstance(payload, int)
                touched |= self.on_target(payload)
            elif kind == "booted":
                assert isinstance(payload, str)
                touched |= self.on_booted(payload)
            else:
                touched |= self.place_fleet()
                self.clock.at(self.clock.now + self.setup.place_every_s, "place")
        return touched

    # -- the trace --------------------------------------------------------------------------

    def live(self) -> list[Instance]:
        return [i for i in self.pool.values() if i.state not in ("gone", "noticed")]

    def on_target(self, count: int) -> set[int]:
        """The cloud offers `count` instances: new ones boot, or random ones are taken back
        (as `Fleet.hold` without a scaler)."""
        live = self.live()
        for _ in range(count - len(live)):
            self.start_instance()
        touched = set()
        for victim in self.rng.sample(live, max(0, len(live) - count)):
            run = self.owner.get(victim.name)
            if run is None:
                victim.state, victim.gone_s = "gone", self.clock.now
                self.counts.preempted_unplaced += 1
            else:
                self.sims[run].fleet.preempt(victim)
                touched.add(run)
        return touched

    def start_instance(self) -> None:
        name = f"spot-{len(self.pool)}"
        profile = self.sc.spot_engine
        engine = SimEngine(profile, verify_step(profile, self.sc.tail.speculation))
        price = self.sc.cloud.spot_instance_per_h
        self.pool[name] = Instance(name, "preemptible", engine, price, self.clock.now)
        if self.setup.runs == 1:  # one run: every instance is its, from the start
            self.join(self.pool[name], 0)
        self.clock.at(self.clock.now + self.sc.cloud.startup_s, "booted", name)

    def on_booted(self, name: str) -> set[int]:
        """A booted instance pulls the weights of the run it serves; with several runs, the
        next placement gives it one (placed first: it holds nothing)."""
        inst = self.pool[name]
        run = self.owner.get(name)
        if inst.state != "booting" or run is None:
            return set()
        self.sims[run].fleet.pull(inst)
        return {run}

    def join(self, inst: Instance, run: int) -> None:
        self.owner[inst.name] = run
        self.sims[run].fleet.instances[inst.name] = inst

    # -- placement --------------------------------------------------------------------------

    def claims(self) -> list[RunClaim]:
        """Each run's claim as its step loop says it (`DemandNotice`): its oldest step's
        unfinished requests while it rolls out, and whether they are its tail."""
        out = []
        for r, sim in enumerate(self.sims):
            st = sim.cur
            unfinished = 0
            if r == self.opening:  # its next step: all of its requests
                unfinished = sim.sc.workload.prompts_per_step * sim.sc.workload.group_size
            elif st is not None and st.step in sim.inflight and st.rollout_end_s is None:
                unfinished = st.table.unfinished_count
            tail = in_tail(unfinished, len(st.lengths) if st is not None else 0)
            out.append(RunClaim(run_id=str(r), share=1.0, wanted=unfinished, tail=tail))
        return out

    def placeable(self) -> list[Instance]:
        """Booted instances that hold a run's weights or none: those pulling are left alone
        until they are up."""
        out = []
        for inst in self.live():
            if inst.name in self.owner:
                if inst.state == "up" and not inst.fetching:
                    out.append(inst)
            elif (
                inst.state == "booting" and inst.born_s + self.sc.cloud.startup_s <= self.clock.now
            ):
                out.append(inst)
        return out

    def place_fleet(self) -> set[int]:
        """The coordinator's placement once: `allot` the pool's slots to the runs' claims,
        `place` every placeable instance; those placed on another run switch to it."""
        instances = self.placeable()
        slots = {i.name: self.slots_of(i) for i in instances}
        allotted = allot(sum(slots.values()), self.claims())
        workers = [FleetWorker(i.name, slots[i.name], self.served(i.name)) for i in instances]
        placed = place(workers, allotted)
        touched: set[int] = set()
        for inst in instances:
            target, held = placed[inst.name], self.served(inst.name)
            if target is None or target == held:
                inst.paused = False  # (a draining one placed back: it serves its run again)
            elif self.setup.leave == "release" or not inst.engine.running:
                touched |= self.switch(inst, int(target))
            else:
                inst.paused = True  # draining: it reads no more of its run's jobs
        return touched

    def slots_of(self, inst: Instance) -> int:
        if self.setup.slots == "plateau":
            return inst.slots()
        if self.setup.slots == "max_seqs":
            return inst.engine.profile.max_seqs
        return self.setup.slots

    def served(self, name: str) -> str | None:
        run = self.owner.get(name)
        return None if run is None else str(run)

    def switch(self, inst: Instance, run: int) -> set[int]:
        """`inst` leaves the run it serves (its requests given back, migrated) and pulls the
        weights of `run`."""
        touched = {run}
        left = self.owner.get(inst.name)
        if left is not None:
            source = self.sims[left]
            source.requests.release(inst, len(inst.engine.running), "balance")
            del source.fleet.instances[inst.name]
            self.counts.switches += 1
            touched.add(left)
        inst.version, inst.paused = None, False
        self.join(inst, run)
        fleet = self.sims[run].fleet
        before = fleet.totals.pull_s
        fleet.pull(inst)
        if left is not None:
            self.counts.switch_pull_s += fleet.totals.pull_s - before
        return touched


def pool_figures(pool: list[Instance], end_s: float, startup_s: float) -> dict:
    """The spot pool's instance-seconds: billed (alive), up (booted: serving, pulling or
    switching) and busy (holding a request); the idle fraction of up time, and of billed."""
    alive = sum(i.alive_s(end_s) for i in pool)
    up = sum(max(0.0, i.alive_s(end_s) - startup_s) for i in pool)
    busy = sum(min(i.engine.busy_s, i.alive_s(end_s)) for i in pool)
    return {
        "pool_idle_frac": 1 - busy / up if up else None,
        "pool_idle_frac_billed": 1 - busy / alive if alive else None,
        "pool_up_s": up,
        "mean_pool_instances": alive / end_s if end_s else 0.0,
        "pool_cost": sum(i.alive_s(end_s) * i.price_per_h / 3600 for i in pool),
    }


def summarize_runs(sims: list[Simulation], pool: list[Instance], end_s: float) -> dict:
    """K runs over `end_s` seconds: every run's trained tokens, the reserved nodes' and the
    pool's bill over the same time, and each run's step count and mean step."""
    sc = sims[0].sc
    nodes = sum(sim.system.reserved_nodes for sim in sims)
    figures = pool_figures(pool, end_s, sc.cloud.startup_s)
    cost = figures.pop("pool_cost") + sc.cloud.reserved_node_per_h * nodes * end_s / 3600
    trained = sum(sim.totals.trained for sim in sims)
    hours = end_s / 3600
    steps = [len(sim.records) for sim in sims]
    return {
        "throughput_tok_s": trained / end_s if end_s else 0.0,
        "tokens_per_dollar": trained / cost if cost else 0.0,
        "cost_per_h": cost / hours if hours else 0.0,
        "steps": steps,
        "mean_step_s": [
            sim.records[-1].end_s / len(sim.records) if sim.records else None for sim in sims
        ],
        "tokens_trained": trained,
        "tokens_generated": sum(sim.totals.generated for sim in sims),
        "tokens_lost": sum(sim.totals.lost for sim in sims),
        "preemptions": sum(sim.totals.preemptions for sim in sims),
        "recalls": sum(sim.totals.recalls for sim in sims),
        "reserved_nodes": nodes,
        **figures,
    }


def compare_many_runs(
    sc: Scenario,
    targets: list[tuple[float, int]],
    setup: ManyRuns = ManyRuns(),
    seed: int = 0,
    horizon_s: float = 3600.0,
    shared_targets: list[tuple[float, int]] | None = None,
) -> dict:
    """The K runs shared and separate on the same trace (`targets`: the whole pool's counts;
    `shared_targets`, the shared pool's where it is sized apart, default the same)."""
    separate = run_separate(sc, setup, targets, seed, horizon_s)
    pools = [i for sim in separate for i in sim.fleet.instances.values() if i.pool != "reserved"]
    end_s = max(sim.clock.now for sim in separate)
    shared_counts = targets if shared_targets is None else shared_targets
    shared = SharedPool(sc, setup, shared_counts, seed, horizon_s).run()
    out_shared = summarize_runs(shared.sims, list(shared.pool.values()), shared.clock.now)
    up_s = out_shared["pool_up_s"]
    out_shared |= {
        "switches": shared.counts.switches,
        "switch_pull_s": shared.counts.switch_pull_s,
        # the share of the pool's up time spent pulling another run's weights (idle in it)
        "switch_frac": shared.counts.switch_pull_s / up_s if up_s else None,
        "preempted_unplaced": shared.counts.preempted_unplaced,
    }
    return {
        "runs": setup.runs,
        "shared": out_shared,
        "separate": summarize_runs(separate, pools, end_s) | {"switches": 0, "switch_frac": 0.0},
    }

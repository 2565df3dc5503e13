"""Several RL runs on one trace (issue 52): one spot pool shared by K runs against K separate
deployments, with the same reserved nodes (one a run) and the same trace.

- separate: K deployments, each a plain `Simulation` of `ManyRuns.system` with its own
  reserved node and its own pool. The trace's spot instances are split evenly: of the n it
  offers, instance i goes to deployment i mod K, so deployment d holds ceil((n - d) / K)
  (`split_targets`).
- shared, `serve="one"`: K runs, each a `Simulation` with its own reserved node and weight
  store and no pool of its own, and one pool (`SharedPool`) that holds every instance the
  trace offers. An instance serves one run at a time. Every `place_every_s` the fleet is
  placed by the coordinator's own policy (`core.fleet_shares`, as
  `coordinator/workers/placement.py` calls it): each run claims its oldest step's unfinished
  requests (its tail flagged, share 1), `allot` splits the pool's slots (`ManyRuns.slots` an
  instance), `place` says which run each instance serves. An instance placed on another run
  gives back what it holds of the one it leaves (cause "balance", migrated; or with
  `leave="drain"` it first finishes them) and pulls the new run's weights: the switch cost is
  that pull (the model's bytes through the run's store and the instance's NIC, `Fleet.pull_s`,
  plus the load; LoRA runs on one base move the adapter alone). With one run every instance
  serves it, as the services do, so K = 1 is the plain simulation. With `place_at_commit` the
  pool is also placed for a run's next step before it opens.
- shared, `serve="all"` (LoRA runs on one base, a worker's SPOTRL_RUNS_AT_ONCE >= K): every
  instance serves every run at once, in one batch (services/sim/lanes.py): it is a lane in
  each run's fleet, and nothing is placed or moved. A booted instance pulls the base and one
  run's adapter from that run's store (instance i: run i mod K), then every other run's adapter
  from its own; a run's new version is an adapter pull of that run's lane, which the other
  lanes serve through. Every `place_every_s` the coordinator's `allot` sets each run's part of
  each instance (`worker_part`), which its reads stop at. K = 1 is the plain simulation too.

Run r queues its first step at r x `stagger_s` (default 0: together), in both setups, and
draws its workload with seed `run_seed(seed, r)` in both, so the same runs are compared. The
clocks of the K runs and the pool's move in lockstep: each advances to the earliest time any of
them needs (`SharedPool.run` carries out `Simulation.run`'s loop body for each run).

What this leaves out: a placement order's delivery and a worker's reaction time (an order is
carried out at once), and placement while an instance pulls (it is placed once it is up).
"""

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from services.core.fleet_shares import FleetWorker, RunClaim, allot, in_tail, place, worker_part
from services.sim.clock import Clock
from services.sim.engine import SimEngine
from services.sim.lanes import Worker, new_worker
from services.sim.scenario import Scenario
from services.sim.simulation import QUANTUM_S, Simulation
from services.sim.state import Instance
from services.sim.systems import HYBRID_ALL_SPOT, HYBRID_ASYNC_K1, SystemSpec
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
    # "one": an instance serves one run at a time, and a move to another run pulls that run's
    # weights (whole; under LoRA its adapter, the base kept); "all": every instance serves
    # every run at once in one batch, each request under its run's adapter (LoRA runs on one
    # base, a worker's SPOTRL_RUNS_AT_ONCE >= runs): no moves, a lane a run (lanes.py). The
    # scenario must be LoRA's (`Scenario.with_lora`), in both setups
    serve: Literal["one", "all"] = "one"
    # run r queues its first step at r x stagger_s, in both setups (every pool, shared or a
    # deployment's own, is held from time 0 all the same)
    stagger_s: float = 0.0
    # serve "all": the pool's engines apply several adapters in one batch, unmerged, decoding
    # at this share of a merged engine's speed (`EngineProfile.decoding_at`); a separate
    # deployment's worker serves one run and may merge its adapter (1.0: as fast)
    unmerged_decode_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.runs < 1 or self.place_every_s <= 0:
            raise ValueError("runs must be >= 1 and place_every_s > 0")
        if isinstance(self.slots, int) and self.slots < 1:
            raise ValueError("slots must be >= 1")
        if self.stagger_s < 0 or not 0 < self.unmerged_decode_factor <= 1:
            raise ValueError("stagger_s must be >= 0 and unmerged_decode_factor within (0, 1]")

    def start_s(self, run: int) -> float:
        """When run `run` queues its first step."""
        return run * self.stagger_s


# the systems a run may be (`ManyRuns.system`): every instance the trace offers is held, so
# that the shared pool is the trace's whole and the separate pools its K parts
MANY_RUNS_SYSTEMS = {
    s.name: s
    for s in (
        HYBRID_ALL_SPOT,
        # asynchronous, k = 1: a run's next step rolls out while its trainer trains
        replace(HYBRID_ASYNC_K1, name="hybrid-async-k1-all-spot", pool_headroom=None),
    )
}


def run_seed(seed: int, run: int) -> int:
    """The workload seed of run `run` (the same in both setups)."""
    return seed + 1000 * run


def split_targets(targets: list[tuple[float, int]], parts: int) -> list[list[tuple[float, int]]]:
    """The trace's counts split among `parts` deployments: instance i goes to deployment
    i mod parts, so deployment d holds ceil((n - d) / parts) of n."""
    return [[(t, (n - d + parts - 1) // parts) for t, n in targets] for d in range(parts)]


class LaterStart(Simulation):
    """A run that queues its first steps at `start_s`, not at time 0 (its reserved node, and
    its pool where it has one, are there from time 0); at 0, the plain simulation."""

    def __init__(
        self,
        sc: Scenario,
        system: SystemSpec,
        targets: list[tuple[float, int]],
        seed: int,
        horizon_s: float,
        start_s: float = 0.0,
    ) -> None:
        super().__init__(sc, system, targets, seed, horizon_s)
        self.start_s = start_s
        self.handlers["start"] = self.on_start

    def start_steps(self) -> None:
        if self.clock.now < self.start_s:
            self.clock.at(self.start_s, "start")
        else:
            super().start_steps()

    def on_start(self, _: object) -> None:
        super().start_steps()


def run_separate(
    sc: Scenario, setup: ManyRuns, targets: list[tuple[float, int]], seed: int, horizon_s: float
) -> list[LaterStart]:
    """K deployments, each with its part of the trace, run d started at `setup.start_s(d)`."""
    sims = [
        LaterStart(sc, setup.system, part, run_seed(seed, d), horizon_s, setup.start_s(d))
        for d, part in enumerate(split_targets(targets, setup.runs))
    ]
    for sim in sims:
        sim.run()
    return sims


@dataclass
class PoolCounts:
    """What the shared pool did besides what each run's totals say."""

    switches: int = 0  # instances moved from one run to another
    switch_pull_s: float = 0.0  # the pulls those moves started, summed
    preempted_unplaced: int = 0  # instances taken back before they served any run
    taken_back: int = 0  # serve "all": instances the trace took back (each run counts its lane)


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
        setup = self.setup
        if setup.serve == "all" and self.sc.transfer.adapter_share is None:
            raise ValueError("serve='all' is for LoRA runs on one base: a Scenario.with_lora")
        self.sims = [
            LaterStart(
                self.sc, setup.system, [], run_seed(self.seed, r), self.horizon_s, setup.start_s(r)
            )
            for r in range(setup.runs)
        ]
        self.pool: dict[str, Instance] = {}  # every spot instance started, in order
        self.owner: dict[str, int] = {}  # instance -> the run it serves (absent: none yet)
        self.workers: dict[str, Worker] = {}  # serve "all": every instance's lanes
        self.rounds = 0  # the loop's rounds so far
        self.profile = self.sc.spot_engine
        if setup.serve == "all":
            self.profile = self.profile.decoding_at(setup.unmerged_decode_factor)
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
            batches = [w.engine for w in self.workers.values() if w.engine.batch]
            for engine in batches:  # (serve "all") each engine once, then each run's lanes
                engine.advance(self.clock.now, t)
            for sim in self.sims:
                self.advance(sim, t)
            for engine in batches:
                engine.thaw()
            self.clock.now = t
            touched = self.handle_events()
            # serving every run at once, an instance's lanes race for its room (the worker's
            # jobs tasks read as they come): the run that reads first goes round
            k = len(self.sims)
            first = self.rounds % k if self.setup.serve == "all" else 0
            self.rounds += 1
            for r in [*range(first, k), *range(first)]:
                sim = self.sims[r]
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
            elif kind == "based":
                assert isinstance(payload, str)
                touched |= self.on_based(payload)
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
            if victim.name in self.workers:
                touched |= self.take_back(self.workers[victim.name])
            elif run is None:
                victim.state, victim.gone_s = "gone", self.clock.now
                self.counts.preempted_unplaced += 1
            else:
                self.sims[run].fleet.preempt(victim)
                touched.add(run)
        return touched

    def start_instance(self) -> None:
        name = f"spot-{len(self.pool)}"
        price, profile = self.sc.cloud.spot_instance_per_h, self.profile
        if self.setup.serve == "all":  # a lane in every run's fleet, from the start
            worker = new_worker(
                len(self.pool),
                profile,
                self.sc.tail.speculation,
                price,
                self.clock.now,
                len(self.sims),
            )
            self.workers[name], self.pool[name] = worker, worker.instance
            for sim, lane in zip(self.sims, worker.lanes, strict=True):
                sim.fleet.instances[name] = lane
        else:
            engine = SimEngine(profile, verify_step(profile, self.sc.tail.speculation))
            self.pool[name] = Instance(name, "preemptible", engine, price, self.clock.now)
            if self.setup.runs == 1:  # one run: every instance is its, from the start
                self.join(self.pool[name], 0)
        self.clock.at(self.clock.now + self.sc.cloud.startup_s, "booted", name)

    def on_booted(self, name: str) -> set[int]:
        """A booted instance pulls the weights of the run it serves; with several runs, the
        next placement gives it one (placed first: it holds nothing). Serving every run: the
        base and its base run's adapter first (`on_based` then pulls the others')."""
        inst = self.pool[name]
        if name in self.workers:
            return self.boot_worker(self.workers[name])
        run = self.owner.get(name)
        if inst.state != "booting" or run is None:
            return set()
        self.sims[run].fleet.pull(inst)
        return {run}

    def boot_worker(self, worker: Worker) -> set[int]:
        """A booted worker's lane of its base run pulls the base and that run's adapter from
        that run's store; the other lanes wait for the base (`on_based`)."""
        inst, run = worker.instance, worker.base_run
        if inst.state != "booting":
            return set()
        inst.state = "up"
        fleet = self.sims[run].fleet
        before = fleet.totals.pull_s
        fleet.pull(worker.lanes[run])
        if len(self.sims) > 1:
            self.clock.at(self.clock.now + fleet.totals.pull_s - before, "based", inst.name)
        return {run}

    def on_based(self, name: str) -> set[int]:
        """The worker holds the base: every other lane pulls its run's adapter alone."""
        worker = self.workers[name]
        if worker.instance.state != "up":
            return set()
        touched = set()
        for run, lane in enumerate(worker.lanes):
            if lane.state == "booting":
                lane.version = self.sims[run].clock.version  # (the base held: the adapter moves)
                self.sims[run].fleet.pull(lane)
                touched.add(run)
        return touched

    def take_back(self, worker: Worker) -> set[int]:
        """The trace takes a worker back: every lane is preempted in its run (with a notice,
        each releases what it holds)."""
        inst, notice = worker.instance, self.sc.cloud.notice_s
        noticed = notice > 0 and inst.state != "booting"
        inst.state = "noticed" if noticed else "gone"
        inst.gone_s = self.clock.now + (notice if noticed else 0.0)
        self.counts.taken_back += 1
        touched = set()
        for run, lane in enumerate(worker.lanes):
            if lane.state not in ("gone", "noticed"):
                self.sims[run].fleet.preempt(lane)
                touched.add(run)
        return touched

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
        `place` every placeable instance; those placed on another run switch to it. Serving
        every run at once, nothing moves: each lane's part is set (`allot_parts`)."""
        if self.setup.serve == "all":
            self.allot_parts()
            return set()
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

    def allot_parts(self) -> None:
        """Serve "all": the coordinator's allotment over the workers up (each run wanting at
        least what its lanes hold, `placement.held_floor`), and each lane's part of its worker
        (`worker_part`: the run's share of the fleet's slots, of the worker's, at least its
        weighted part of them: 1/K, every share 1), which its reads stop at."""
        up = [w for w in self.workers.values() if w.instance.state == "up"]
        slots = {w.instance.name: self.slots_of(w.instance) for w in up}
        fleet = sum(slots.values())
        held = [sum(w.lanes[r].engine.batch for w in up) for r in range(len(self.sims))]
        claims = [replace(c, wanted=max(c.wanted, held[r])) for r, c in enumerate(self.claims())]
        allotted = allot(fleet, claims)
        floor = 1 / len(self.sims)
        for w in up:
            mine = slots[w.instance.name]
            for r, lane in enumerate(w.lanes):
                lane.part = worker_part(allotted[str(r)], fleet, mine, floor)

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
        if self.sc.transfer.adapter_share is None:
            inst.version = None  # another run's weights: a whole pull
        # (LoRA runs on one base: it keeps the base and pulls the new run's adapter)
        if left is not None:
            source = self.sims[left]
            source.requests.release(inst, len(inst.engine.running), "balance")
            del source.fleet.instances[inst.name]
            self.counts.switches += 1
            touched.add(left)
        inst.paused = False
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


def summarize_runs(sims: Sequence[LaterStart], pool: list[Instance], end_s: float) -> dict:
    """K runs over `end_s` seconds: every run's trained tokens, the reserved nodes' and the
    pool's bill over the same time, and each run's start, step count and mean step."""
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
            (sim.records[-1].end_s - sim.records[0].start_s) / len(sim.records)
            if sim.records
            else None
            for sim in sims
        ],
        "first_step_s": [sim.start_s for sim in sims],
        "tokens_trained": trained,
        "tokens_generated": sum(sim.totals.generated for sim in sims),
        "tokens_lost": sum(sim.totals.lost for sim in sims),
        "preemptions": sum(sim.totals.preemptions for sim in sims),
        "recalls": sum(sim.totals.recalls for sim in sims),
        "reserved_nodes": nodes,
        **figures,
    }


def several_runs_frac(shared: SharedPool) -> float | None:
    """Of the shared pool's busy instance-seconds, the share in which an instance's one batch
    held requests of two runs or more (None: no instance serves several)."""
    busy = sum(w.engine.busy_s for w in shared.workers.values())
    if not busy:
        return None
    return sum(w.engine.several_s for w in shared.workers.values()) / busy


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
        # serve "all": the share of the pool's busy seconds with two runs or more in a batch
        "several_runs_frac": several_runs_frac(shared),
    }
    if setup.serve == "all":  # an instance taken back once, not once a lane
        out_shared["preemptions"] = shared.counts.taken_back
    return {
        "runs": setup.runs,
        "shared": out_shared,
        "separate": summarize_runs(separate, pools, end_s) | {"switches": 0, "switch_frac": 0.0},
    }

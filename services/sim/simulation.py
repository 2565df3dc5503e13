"""Discrete-event simulation of one system on one availability trace, driving the coordinator's
own policy code: `SeedingController` (Algorithm 1) sets T_seed, `balancer.releases`
(Algorithm 2) orders releases, `RequestTable` keeps every response (leases, offsets, migration),
`PlateauEstimator` sizes each worker's batch, `recommended_pool_size` gives N_prem.

One clock in simulated seconds. Engines advance continuously between events (engine.py); the
events are trace changes, boots, weight pulls, preemptions and their detection, the seeding
window, the trainer's micro-batches and version commits. The step protocol is the services':
jobs wait in one queue that instances holding the step's version read up to their plateau batch
size; finished groups go to the trainer in completion order; the trainer commits version v+1,
and every instance pulls it.

With `SystemSpec.max_staleness` k > 0 (asynchronous RL) up to k + 1 steps are in flight: step s
is queued once version s - k is committed, an instance holding version v reads the jobs of the
steps s with v >= s - k (oldest step first), and a committed version is pulled in the background
while the instance keeps generating (no drain). k = 0 is the synchronous protocol above.

A multi-turn workload (`ResponseLengthModel.turns` > 1) runs episodes: a turn's end waits for
the environment's answer (an event after its latency), then the next turn is queued like a
continuation (turns.py, over the coordinator's `EpisodeTable`).

This module holds the event loop and the reserved node's recall; the instances' events are in
instances.py, the requests' in requests.py, the steps' in steps.py, the turns' in turns.py (each
a mixin of `Simulation`).
"""

import heapq
import itertools
import math
import random

from services.contracts.runspec import RolloutSection
from services.core.collect import CollectRules
from services.core.seeding import PoolSizer, SeedingController, recall
from services.sim.engine import SimEngine
from services.sim.instances import InstanceLifecycle
from services.sim.requests import RequestFlow
from services.sim.scenario import Scenario
from services.sim.state import Instance, StepRecord, StepState, Totals
from services.sim.steps import StepProtocol
from services.sim.systems import SystemSpec
from services.sim.turns import TurnFlow

QUANTUM_S = 5.0  # the longest an engine runs at one step rate (contexts grow meanwhile)


class Simulation(StepProtocol, InstanceLifecycle, RequestFlow, TurnFlow):
    def __init__(
        self,
        scenario: Scenario,
        system: SystemSpec,
        targets: list[tuple[float, int]],
        seed: int = 0,
        horizon_s: float = math.inf,
        max_steps: int | None = None,
    ) -> None:
        self.sc, self.system, self.seed = scenario, system, seed
        self.horizon_s, self.max_steps = horizon_s, max_steps
        self.now = 0.0
        self.rng = random.Random(f"{seed}:victims")
        self.totals = Totals()
        self.instances: dict[str, Instance] = {}
        self.version = 0  # latest committed weights
        self.cur: StepState | None = None  # the oldest step in flight: the one the trainer takes
        self.inflight: dict[int, StepState] = {}  # steps queued and not committed, oldest first
        self.max_lag = 0  # the most a job's step was ahead of its instance's weights at start
        self.resuming = False  # the reserved engines are switching to rollout (a recall)
        self.trainer_back_s = 0.0  # asynchronous RL: the node switches back to training until
        self.busy_mark = (0.0, 0.0)  # asynchronous RL: rollout busy seconds at the last commit
        self.records: list[StepRecord] = []
        self.spot_timeline: list[tuple[float, int]] = []  # the trace: instances offered
        self.available = 0  # instances the cloud offers now
        self.wanted: int | None = None  # the pool the coordinator asks for (None: all)
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._names = itertools.count()
        t_seed = {"adaptive": scenario.initial_t_seed_s, "off": 0.0, "colocated": math.inf}
        self.rules = CollectRules(migration=system.migration)
        headroom = system.pool_headroom
        self.pool_sizer = (
            PoolSizer(headroom) if system.pool == "trace" and headroom is not None else None
        )
        defaults = RolloutSection()
        self.seeding = SeedingController(
            t_seed_s=t_seed[system.seeding],
            eta=scenario.seeding_eta,
            wait_share=defaults.seeding_wait_share,
            backoff=defaults.seeding_backoff,
            max_seed_s=1e9,
        )
        for i in range(scenario.reserved_engines * system.reserved_nodes):
            engine = SimEngine(scenario.reserved_engine)
            self.instances[f"reserved-{i}"] = Instance(
                f"reserved-{i}", "reserved", engine, 0.0, 0.0, state="up", paused=True
            )
        if system.pool == "trace":
            for at, count in targets:
                self.at(at, "target", count)
        elif system.pool == "fixed":
            self.at(0.0, "target", system.fixed_instances)

    # -- the loop -------------------------------------------------------------------------

    def at(self, t: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self) -> "Simulation":
        self.start_steps()
        while self.now < self.horizon_s and not self.finished():
            busy = [i for i in self.instances.values() if i.engine.running]
            t = min(
                self._events[0][0] if self._events else math.inf,
                min((self.now + i.engine.next_stop_s(self.now) for i in busy), default=math.inf),
                self.now + QUANTUM_S if busy else math.inf,
                self.horizon_s,
            )
            if math.isinf(t):
                break  # nothing can happen any more (the trace ended with no instance)
            self._account(t, busy)
            for inst in busy:
                inst.engine.advance(self.now, t)
            self.now = t
            for inst in busy:
                for rid in inst.engine.stopped():
                    self.finish_request(inst, rid)
            while self._events and self._events[0][0] <= self.now:
                _, _, kind, payload = heapq.heappop(self._events)
                getattr(self, f"on_{kind}")(payload)
            if self.system.pool == "trace":
                self.recall_reserved()
            self.dispatch()
            self.balance()
        return self

    def finished(self) -> bool:
        return self.max_steps is not None and len(self.records) >= self.max_steps

    def _account(self, t: float, busy: list[Instance]) -> None:
        dt = t - self.now
        if any(i.pool == "reserved" for i in busy):
            self.totals.reserved_rollout_s += dt
        if self.stalled():
            self.totals.stall_s += dt

    def stalled(self) -> bool:
        """Jobs wait, the reserved pool stepped aside and was not recalled, and no preemptible
        worker is alive: the step waits for the trace to bring an instance back. The recall
        (`core.seeding.recall`) makes this 0 by construction: it is counted as a check."""
        if self.system.max_staleness:
            return self.stalled_async()
        waiting = any(
            st.queue and st.seeded_out and not st.recalled for st in self.inflight.values()
        )
        return waiting and not any(i.has_heartbeat for i in self.pool_instances())

    def stalled_async(self) -> bool:
        """Asynchronous RL: jobs wait, no preemptible worker is alive, and the reserved node
        neither generates nor has anything to train (then it is recalled: 0 by construction)."""
        return (
            any(st.queue for st in self.inflight.values())
            and not any(i.has_heartbeat for i in self.pool_instances())
            and not (self.resuming or self.reserved_generating() or self.trainer_has_work())
        )

    def recall_reserved(self) -> None:
        """No preemptible instance is left after the seeding window: the reserved engines
        resume the step (after a switch), as the coordinator's step controller orders them
        (`StepController.tick`)."""
        if self.system.max_staleness:
            self.recall_async()
            return
        for st in list(self.inflight.values()):
            if st.recalled or st.rollout_end_s is not None:
                continue
            n_pool = sum(1 for i in self.pool_instances() if i.has_heartbeat)
            if recall(st.seeded_out, n_pool, st.table.unfinished_count):
                self.recall_for(st)

    def recall_for(self, st: StepState) -> None:
        st.recalled = True
        self.totals.recalls += 1
        self.resuming = True
        self.totals.reserved_switch_s += self.sc.resume_s
        self.at(self.now + self.sc.resume_s, "recalled", st.step)

    def recall_async(self) -> None:
        """Asynchronous RL: the reserved node trains; when no preemptible instance is alive,
        jobs wait and the trainer has nothing to do, its engines resume (after a switch) and
        generate, the oldest step first, while the trainer waits (they share the GPUs); they
        step aside again once the oldest step's rollout is complete (`step_aside_async`)."""
        if self.resuming or self.reserved_generating() or self.trainer_has_work():
            return
        n_pool = sum(1 for i in self.pool_instances() if i.has_heartbeat)
        waiting = [st for st in self.inflight.values() if st.rollout_end_s is None]
        if not any(recall(st.seeded_out, n_pool, st.table.unfinished_count) for st in waiting):
            return
        for st in waiting:
            st.recalled = True
        self.recall_for(waiting[0])

    def reserved_generating(self) -> bool:
        return any(not i.paused for i in self.reserved())

    def on_recalled(self, step: int) -> None:
        self.resuming = False
        if self.system.max_staleness:
            if not self.trainer_has_work():  # (else the switch back would follow at once)
                for inst in self.reserved():
                    inst.version, inst.paused = self.version, False
            self.train_next()
            return
        if self.cur is None or self.cur.step != step:
            return
        for inst in self.reserved():
            inst.version, inst.paused = step, False

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
"""

import heapq
import itertools
import math
import random
from typing import TypeVar

from services.contracts.messages import (
    DeltaBatch,
    DeltaItem,
    FinishReason,
    Job,
    ReleaseReason,
    RequestLease,
)
from services.contracts.runspec import RunSpec
from services.core.balancer import WorkerLoad, equal_caps, read_cap, releases
from services.core.collect import CollectRules, apply_batches, keeps_tokens
from services.core.seeding import PoolSizer, SeedingController, recall
from services.sim.engine import SimEngine
from services.sim.scenario import Scenario
from services.sim.state import Instance, StepRecord, StepState, Totals
from services.sim.steps import StepProtocol
from services.sim.systems import SystemSpec

T = TypeVar("T")

QUANTUM_S = 5.0  # the longest an engine runs at one step rate (contexts grow meanwhile)


class Simulation(StepProtocol):
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
        defaults = RunSpec.model_fields
        self.seeding = SeedingController(
            t_seed_s=t_seed[system.seeding],
            eta=scenario.seeding_eta,
            wait_share=defaults["seeding_wait_share"].default,
            backoff=defaults["seeding_backoff"].default,
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
        resume the step (after a switch), as the coordinator's `StepScheduler` orders them."""
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

    # -- instances --------------------------------------------------------------------------

    def on_target(self, count: int) -> None:
        """The trace: the cloud now offers `count` instances. An instance it takes back is
        preempted (a random one of those held); a scaler holds min(offered, wanted)."""
        self.available = count
        self.spot_timeline.append((self.now, count))
        self.hold(count if self.wanted is None else min(count, self.wanted), scale_in=False)

    def want(self, wanted: int | None) -> None:
        """The scaler follows the coordinator's `preemptible_wanted`, between steps (the pool
        is idle then: an instance handed back loses no work)."""
        self.wanted = wanted
        target = self.available if wanted is None else min(self.available, wanted)
        self.hold(target, scale_in=True)

    def hold(self, count: int, scale_in: bool) -> None:
        live = [i for i in self.pool_instances() if i.state != "noticed"]
        for _ in range(count - len(live)):
            name = f"spot-{next(self._names)}"
            price = self.sc.cloud.spot_instance_per_h
            if self.system.pool == "fixed":
                price = self.sc.cloud.ondemand_instance_per_h
            self.instances[name] = Instance(
                name, "preemptible", SimEngine(self.sc.spot_engine), price, self.now
            )
            self.at(self.now + self.sc.cloud.startup_s, "booted", name)
        excess = max(0, len(live) - count)
        if not scale_in:
            for victim in self.rng.sample(live, excess):
                self.preempt(victim)
            return
        # handed back: those not serving yet first, then the newest
        order = {"booting": 0, "pulling": 1, "up": 2}
        live.sort(key=lambda i: (order.get(i.state, 3), -i.born_s))
        for inst in live[:excess]:
            self.release(inst, len(inst.engine.running), "preemption")  # none between steps
            self.totals.scaled_in += 1
            self.on_gone(inst.name)

    def pool_instances(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.pool == "preemptible" and i.state != "gone"]

    def on_booted(self, name: str) -> None:
        inst = self.instances[name]
        if inst.state == "booting":
            self.pull(inst)

    def pull(self, inst: Instance) -> None:
        inst.state = "pulling"
        self.at(self.now + self.pull_s(), "pulled", (inst.name, self.version))

    def pull_s(self) -> float:
        """A pull started now: the weight store's egress is shared by every pull under way
        (with peer-to-peer fan-out, the pullers serve each other: `TransferModel`)."""
        pulling = sum(
            1
            for i in self.instances.values()
            if i.state == "pulling" or (i.fetching and i.state == "up")
        )
        seconds = self.sc.transfer.pull_s(pulling)
        self.totals.pulls += 1
        self.totals.pull_s += seconds
        self.totals.max_pull_s = max(self.totals.max_pull_s, seconds)
        return seconds

    def fetch(self, inst: Instance) -> None:
        """Asynchronous RL: pull the latest version in the background; the instance keeps
        generating its running requests with the weights it holds."""
        inst.fetching = True
        self.at(self.now + self.pull_s(), "fetched", (inst.name, self.version))

    def on_fetched(self, payload: tuple[str, int]) -> None:
        """The pull is loaded: the instance switches to it between two decode steps and its
        running requests continue under it (no drain, no restart)."""
        name, version = payload
        inst = self.instances[name]
        inst.fetching = False
        if inst.state != "up":
            return  # preempted (or told to go) meanwhile
        inst.version = version
        if version < self.version:
            self.fetch(inst)  # a newer version was committed meanwhile

    def on_pulled(self, payload: tuple[str, int]) -> None:
        name, version = payload
        inst = self.instances[name]
        if inst.state != "pulling":
            return  # preempted while pulling
        inst.version = version
        if version >= self.version:
            inst.state = "up"
        elif self.system.max_staleness:
            inst.state = "up"  # it may serve the steps its version is recent enough for
            self.fetch(inst)
        else:
            self.pull(inst)  # a newer version was committed meanwhile

    def preempt(self, inst: Instance) -> None:
        self.totals.preemptions += 1
        notice = self.sc.cloud.notice_s
        if notice > 0 and inst.state != "booting":
            self.release(inst, len(inst.engine.running), "preemption")  # flush, release, exit
            inst.state = "noticed"
            self.at(self.now + notice, "gone", inst.name)
            return
        held, items = [], []
        for rid in list(inst.engine.running):
            st = self.step_of(rid)
            run, tokens = inst.engine.remove(rid)
            self.totals.generated += tokens
            flushed = tokens - tokens % self.sc.flush_tokens
            self.totals.lost_unflushed += tokens - flushed
            items.append((st, self.delta(st, rid, run.lease, run.offset, flushed, False)))
            held.append((rid, run.lease))
        for st, step_items in self.by_step(items):  # what it flushed before it died
            self.collect(
                st,
                DeltaBatch(
                    worker_id=inst.name, version=self.held_version(inst, st), items=step_items
                ),
            )
        self.on_gone(inst.name)
        if held:
            self.at(self.now + self.sc.cloud.heartbeat_ttl_s, "detected", held)

    def on_gone(self, name: str) -> None:
        inst = self.instances[name]
        inst.state, inst.gone_s = "gone", self.now

    def on_detected(self, held: list[tuple[str, int]]) -> None:
        """A dead instance's heartbeat expired: migrate what it held, each request on its own."""
        for rid, lease in held:
            self.migrate(rid, "death", lease)

    # -- requests ---------------------------------------------------------------------------

    def step_of(self, rid: str) -> StepState:
        """The step in flight that request `rid` belongs to."""
        for st in self.inflight.values():
            if rid in st.lengths:
                return st
        raise KeyError(f"request {rid} belongs to no step in flight")

    def by_step(self, items: list[tuple[StepState, T]]) -> list[tuple[StepState, list[T]]]:
        """`items` grouped by their step, oldest step first, each in its order."""
        out: dict[int, tuple[StepState, list[T]]] = {}
        for st, item in items:
            out.setdefault(st.step, (st, []))[1].append(item)
        return [out[step] for step in sorted(out)]

    def held_version(self, inst: Instance, st: StepState) -> int:
        """The weights the instance generated the step's tokens with, as its flush says."""
        return inst.version if inst.version is not None else st.step

    def takes(self, inst: Instance, st: StepState) -> bool:
        """Whether the instance may read the step's jobs: up, not stepped aside, holding a
        version no older than the step minus k (none newer than the step exists while it
        runs). With k > 0 the reserved engines read only the steps they were recalled for."""
        k = self.system.max_staleness
        return (
            inst.state == "up"
            and not inst.paused
            and inst.version is not None
            and st.step - k <= inst.version <= st.step
            and (k == 0 or inst.pool != "reserved" or st.recalled)
        )

    def takers(self, st: StepState) -> list[Instance]:
        return [i for i in self.instances.values() if self.takes(i, st)]

    def held(self, inst: Instance, st: StepState) -> int:
        """Requests of the step the instance runs."""
        if len(self.inflight) == 1:
            return inst.engine.batch
        return sum(1 for rid in inst.engine.running if rid in st.lengths)

    def dispatch(self) -> None:
        """Ready instances read jobs up to their plateau batch size, as each polls the stream
        (least loaded first), the oldest step's first; with `fair_reads`, up to each step's
        read cap too."""
        for st in list(self.inflight.values()):
            self.dispatch_step(st)

    def dispatch_step(self, st: StepState) -> None:
        if not st.queue:
            return
        takers = sorted(self.takers(st), key=lambda i: (i.engine.batch, i.name))
        held = {i.name: self.held(i, st) for i in takers}
        cap = read_cap(len(st.queue) + sum(held.values()), self.serving(st))
        for inst in takers:
            room = inst.slots() - inst.engine.batch
            if self.system.fair_reads:
                room = min(room, cap - held[inst.name])
            for _ in range(max(0, room)):
                if not st.queue:
                    return
                self.start_job(inst, st.queue.popleft())

    def serving(self, st: StepState) -> int:
        """The instances serving the step's version or loading it, as the coordinator counts
        them (`scheduling.serving`): registered, and not a reserved engine that stepped aside."""
        return sum(
            1
            for i in self.instances.values()
            if i.has_heartbeat and (i.pool != "reserved" or not st.seeded_out)
        )

    def start_job(self, inst: Instance, job: Job) -> None:
        st = self.step_of(job.request_id)
        assert inst.version is not None and inst.version >= st.step - self.system.max_staleness
        self.max_lag = max(self.max_lag, st.step - inst.version)
        tokens = st.lengths[job.request_id] - len(job.prefix_ids)
        context = len(job.prompt_ids) + len(job.prefix_ids)
        inst.engine.add(job.request_id, job.lease, context, len(job.prefix_ids), tokens, self.now)

    def balance(self) -> None:
        """Algorithm 2 over the instances that serve some step in flight, with the cooldown of
        the oldest step still rolling out; a release gives back the oldest requests, of any
        step, which go back to their steps' queues."""
        rolling = [st for st in self.inflight.values() if st.rollout_end_s is None]
        if not self.system.balancing or not rolling:
            return
        steps = list(self.inflight.values())
        takers = {
            i.name: i for i in self.instances.values() if any(self.takes(i, st) for st in steps)
        }
        loads = [WorkerLoad(n, i.engine.batch, i.slots()) for n, i in takers.items()]
        if self.system.fair_reads:
            loads = equal_caps(loads)
        wanted = releases(loads, sum(len(st.queue) for st in steps))
        orders, held = rolling[0].release_gate.due(wanted, self.now)
        for at in held:
            self.at(at, "wake")
        for name, count in orders.items():
            self.release(takers[name], count, "balance")
        self.dispatch()

    def on_wake(self, _: object) -> None:
        """Nothing to do: the loop balances after every event."""

    def release(self, inst: Instance, count: int, cause: ReleaseReason) -> None:
        """The worker flushes and gives back `count` requests (oldest first, as the worker)."""
        items = []
        for rid in list(inst.engine.running)[:count]:
            st = self.step_of(rid)
            run, tokens = inst.engine.remove(rid)
            self.totals.generated += tokens
            delta = self.delta(st, rid, run.lease, run.offset, tokens, finished=False)
            items.append((st, (delta, RequestLease(request_id=rid, lease=run.lease))))
        for st, pairs in self.by_step(items):
            batch = DeltaBatch(
                worker_id=inst.name,
                version=self.held_version(inst, st),
                items=[d for d, _ in pairs],
                released=[r for _, r in pairs],
                release_reason=cause,
            )
            self.collect(st, batch)

    def migrate(self, rid: str, cause: str, lease: int) -> None:
        """The coordinator reclaims a request of a dead worker (`migration.py`)."""
        st = self.step_of(rid)
        before = st.table.tokens_discarded
        job = st.table.migrate(rid, cause, keeps_tokens(self.system.migration, cause), lease)
        self.totals.discarded += st.table.tokens_discarded - before
        if job is not None:
            self.queue_continuations(st, {cause: [job]})

    def delta(
        self, st: StepState, rid: str, lease: int, offset: int, tokens: int, finished: bool
    ) -> DeltaItem:
        """What a worker flushes for one request (token values do not matter here)."""
        reason: FinishReason | None = None
        if finished:
            full = st.lengths[rid] >= self.sc.workload.max_response_tokens
            reason = "length" if full else "stop"
        return DeltaItem(
            request_id=rid,
            lease=lease,
            offset=offset,
            token_ids=[0] * tokens,
            logprobs=[0.0] * tokens,
            finished=finished,
            finish_reason=reason,
        )

    def collect(self, st: StepState, batch: DeltaBatch) -> None:
        """The coordinator applies a flush of the step's requests (`collect.apply_batches`, as
        the services do): the continuations are queued and the groups it completed go to the
        trainer."""
        before = st.table.tokens_discarded
        outcome = apply_batches(st.table, [batch], self.rules)
        self.totals.discarded += st.table.tokens_discarded - before
        self.queue_continuations(st, outcome.released)
        groups = st.table.completed_groups(outcome.finished)
        st.table.mark_published(groups)
        for prompt in groups:
            self.group_done(st, prompt)

    def queue_continuations(self, st: StepState, released: dict[str, list[Job]]) -> None:
        for cause, jobs in released.items():
            st.queue.extend(jobs)
            self.totals.migrations[cause] = self.totals.migrations.get(cause, 0) + len(jobs)

    def finish_request(self, inst: Instance, rid: str) -> None:
        st = self.step_of(rid)
        run, _ = inst.engine.remove(rid)
        tokens = round(run.stop_level - run.join_level)
        self.totals.generated += tokens
        item = self.delta(st, rid, run.lease, run.offset, tokens, finished=True)
        self.collect(
            st, DeltaBatch(worker_id=inst.name, version=self.held_version(inst, st), items=[item])
        )

"""The simulation's requests: instances reading jobs up to their plateau batch size
(the oldest step's first, under each step's read cap with `fair_reads`), Algorithm 2's releases
(`balancer.releases`, through the step controller's `balance`), and every flush (a release, a
finished request, what a dying instance flushed) applied by the coordinator's own step
controller (`on_deltas`, then `stored`) to the step's `RequestTable`, whose completed groups go
to the trainer (`Simulation.group_done`); a multi-turn episode's ended turns go to the
environment, whose answer (an event) the controller takes (`on_answers`, then `stored`): the
next turn queued or the episode over (turns.py holds the episodes' table and physics); a dead
instance's jobs are reclaimed by the controller (`on_claimed`). The component is
`RequestFlow`, held as `sim.requests`. With the long tail's options (tail.py) a job with a
draft runs at its acceptance's speed (`draft_speed`), a group's first finished response gives
its running siblings a draft (`sibling_finished`), and length-aware dispatch keeps a step's
queue longest expected first and deals it in turn (`order_queue`, `deal`).
"""

from collections import deque
from collections.abc import Callable
from typing import Final, TypeVar

from services.contracts.messages import (
    DeltaBatch,
    DeltaItem,
    FinishReason,
    Job,
    ReleaseReason,
    RequestLease,
)
from services.core.balancer import WorkerLoad, read_cap
from services.core.episodes import EpisodeTable, Observation
from services.sim.clock import Clock
from services.sim.scenario import Scenario
from services.sim.state import Instance, StepState, Totals
from services.sim.systems import SystemSpec

T = TypeVar("T")
CLAIMER: Final = "coordinator"  # the consumer a coordinator claims a dead reader's jobs with


class RequestFlow:
    """The requests of the steps in flight, over the instances (`instances`, the fleet's: read
    here, never added to). A completed group goes back to the step side (`group_done`)."""

    def __init__(
        self,
        clock: Clock,
        sc: Scenario,
        system: SystemSpec,
        totals: Totals,
        inflight: dict[int, StepState],
        instances: dict[str, Instance],
        group_done: Callable[[StepState, int], None],
    ) -> None:
        self.clock, self.sc, self.system, self.totals = clock, sc, system, totals
        self.inflight = inflight  # the simulation's steps queued and not committed, oldest first
        self.instances = instances
        self.group_done = group_done
        self.max_lag = 0  # the most a job's step was ahead of its instance's weights at start

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
        if st.expected:  # length-aware: one job at a time in turn, the long ones spread
            self.deal(st, takers, held, cap)
            return
        for inst in takers:
            room = inst.slots() - inst.engine.batch
            if self.system.fair_reads:
                room = min(room, cap - held[inst.name])
            for _ in range(max(0, room)):
                if not st.queue:
                    return
                self.start_job(inst, st.queue.popleft())

    def deal(self, st: StepState, takers: list[Instance], held: dict[str, int], cap: int) -> None:
        """Length-aware dispatch: the queue, longest expected first, dealt one job at a time
        to each instance in turn, each up to its room (as `dispatch_step`)."""
        rooms = {}
        for inst in takers:
            room = inst.slots() - inst.engine.batch
            if self.system.fair_reads:
                room = min(room, cap - held[inst.name])
            rooms[inst.name] = room
        active = [i for i in takers if rooms[i.name] > 0]
        while st.queue and active:
            for inst in list(active):
                if not st.queue:
                    return
                self.start_job(inst, st.queue.popleft())
                rooms[inst.name] -= 1
                if rooms[inst.name] <= 0:
                    active.remove(inst)

    def order_queue(self, st: StepState) -> None:
        """Length-aware dispatch: the step's queue, longest expected remainder first."""
        if st.expected:
            key = lambda job: len(job.prefix_ids) - st.expected[job.request_id]  # noqa: E731
            st.queue = deque(sorted(st.queue, key=key))

    def serving(self, st: StepState) -> int:
        """The instances serving the step's version or loading it, as the coordinator counts
        them (`core.step_controller.serving`): registered, and not a reserved engine that
        stepped aside."""
        return sum(
            1
            for i in self.instances.values()
            if i.has_heartbeat and (i.pool != "reserved" or not st.control.seeded_out)
        )

    def start_job(self, inst: Instance, job: Job) -> None:
        st = self.step_of(job.request_id)
        assert inst.version is not None and inst.version >= st.step - self.system.max_staleness
        self.max_lag = max(self.max_lag, st.step - inst.version)
        tokens = st.stop_at(job.request_id) - len(job.prefix_ids)
        context = len(job.prompt_ids) + len(job.prefix_ids)
        speed = self.draft_speed(st, job.request_id, tokens)
        inst.engine.add(
            job.request_id, job.lease, context, len(job.prefix_ids), tokens, self.clock.now, speed
        )

    def draft_speed(self, st: StepState, rid: str, tokens: float) -> float | None:
        """Speculation (tail.py): tokens a step over the next `tokens` of `rid`, when it has a
        draft (an earlier epoch's response to its prompt, or a finished sibling's); None: plain."""
        spec = self.sc.tail.speculation
        if spec is None or not (
            self.sc.tail.has_history(st.step) or prompt_of(rid) in st.drafted_groups
        ):
            return None
        return spec.speed(round(tokens), st.alphas[rid], st.spec_rng)

    def sibling_finished(self, st: StepState, rid: str) -> None:
        """A response is over: its group's others have a draft from now on (the first time,
        when the step has no history): the running ones speed up where they run."""
        prompt = prompt_of(rid)
        if prompt in st.drafted_groups or self.sc.tail.has_history(st.step):
            return
        st.drafted_groups.add(prompt)
        for inst in self.instances.values():
            for other, run in list(inst.engine.running.items()):
                if other in st.lengths and prompt_of(other) == prompt:
                    left = run.tokens - run.at(inst.engine.level)
                    speed = self.draft_speed(st, other, left)
                    if speed is not None and left >= 1:
                        inst.engine.set_speed(other, speed)

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
        queued = sum(len(st.queue) for st in steps)
        orders, held = rolling[0].control.balance(loads, queued, self.clock.now)
        for at in held:
            self.clock.at(at, "wake")
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
            lease = RequestLease(request_id=rid, lease=run.lease, grant=delta.grant)
            items.append((st, (delta, lease)))
        for st, pairs in self.by_step(items):
            batch = DeltaBatch(
                worker_id=inst.name,
                version=self.held_version(inst, st),
                items=[d for d, _ in pairs],
                released=[r for _, r in pairs],
                release_reason=cause,
            )
            self.collect(st, batch)

    def reclaim(self, worker: str, held: list[tuple[str, int]]) -> None:
        """The coordinator reclaims the jobs a dead worker held, (request, lease) each, once its
        heartbeat expired: each step's controller decides which continue (`on_claimed`, by
        `core.reclaim`, as `coordinator/step/leadership.reclaim` calls it) and their jobs are
        queued."""
        claimed = [(self.step_of(rid), (rid, lease)) for rid, lease in held]
        for st, pairs in self.by_step(claimed):
            jobs = [st.table.job(rid).replace(lease=lease) for rid, lease in pairs]  # as read
            before = st.table.tokens_discarded
            effects = st.control.on_claimed(worker, [], jobs, CLAIMER)
            self.totals.discarded += st.table.tokens_discarded - before
            self.queue_jobs(st, effects.jobs, effects.migrated)

    def delta(
        self, st: StepState, rid: str, lease: int, offset: int, tokens: int, finished: bool
    ) -> DeltaItem:
        """What a worker flushes for one request (token values do not matter here)."""
        reason: FinishReason | None = None
        if finished:
            full = offset + tokens >= self.sc.workload.max_response_tokens
            reason = "length" if full else "stop"
        return DeltaItem(
            request_id=rid,
            lease=lease,
            grant=grant_of(st, rid, lease),
            offset=offset,
            token_ids=[0] * tokens,
            logprobs=[0.0] * tokens,
            finished=finished,
            finish_reason=reason,
        )

    def collect(self, st: StepState, batch: DeltaBatch) -> None:
        """The coordinator applies a flush of the step's requests (the step controller's
        `on_deltas`, as the services do): the continuations are queued and the groups it
        completed go to the trainer."""
        before = st.table.tokens_discarded
        effects = st.control.on_deltas([batch])
        self.totals.discarded += st.table.tokens_discarded - before
        self.queue_jobs(st, effects.jobs, effects.migrated)
        if self.sc.tail.speculation is not None:
            for item in batch.items:
                if item.finished and st.table.requests[item.request_id].done:
                    self.sibling_finished(st, item.request_id)
        if effects.turns:  # multi-turn: for the environment (turns.py)
            self.turns_ended(st, effects.turns)
        st.control.stored(effects)
        for prompt in effects.publish:
            self.group_done(st, prompt)

    def queue_jobs(self, st: StepState, jobs: list[Job], migrated: dict[str, int]) -> None:
        """The controller's jobs queued, the requests moved counted by cause."""
        st.queue.extend(jobs)
        if jobs and st.expected:
            self.order_queue(st)
        for cause, n in migrated.items():
            if n:
                self.totals.migrations[cause] = self.totals.migrations.get(cause, 0) + n

    def finish_request(self, inst: Instance, rid: str) -> None:
        st = self.step_of(rid)
        run, _ = inst.engine.remove(rid)
        tokens = run.tokens
        self.totals.generated += tokens
        item = self.delta(st, rid, run.lease, run.offset, tokens, finished=True)
        self.collect(
            st, DeltaBatch(worker_id=inst.name, version=self.held_version(inst, st), items=[item])
        )

    # -- multi-turn episodes (turns.py) ---------------------------------------------------

    def turns_ended(self, st: StepState, rids: list[str]) -> None:
        """Turns a flush ended: the environment answers each after its latency."""
        for rid in rids:
            table = st.table
            assert isinstance(table, EpisodeTable)
            seconds = st.env_latency_s[rid][table.episodes[rid].turns - 1]
            self.totals.env_s += seconds
            self.clock.at(
                self.clock.now + seconds, "env_answer", (st.step, rid, table.requests[rid].lease)
            )

    def on_env_answer(self, payload: tuple[int, str, int]) -> None:
        """The environment answers a turn (`EpisodeTable.observe`, as the coordinator's
        episodes runner does): the step controller's `on_answers` queues the next turn, or
        takes the episode over (after the workload's last turn, or when the budget has no room
        left) with the groups it completes, published once stored (`stored`)."""
        step, rid, lease = payload
        st = self.inflight[step]  # a step with a turn awaiting an answer is not committed
        table = st.table
        assert isinstance(table, EpisodeTable)
        r = table.requests[rid]
        done = table.episodes[rid].turns >= table.max_turns
        tokens = [] if done else [0] * self.sc.workload.observation_tokens
        job = table.observe(rid, lease, Observation(tokens, 0.0, done))
        self.totals.env_answers += 1
        over = [rid] if job is None and r.done else []
        self.totals.episodes += len(over)
        effects = st.control.on_answers([job] if job is not None else [], over)
        self.queue_jobs(st, effects.jobs, effects.migrated)
        st.control.stored(effects)
        for prompt in effects.publish:
            self.group_done(st, prompt)


def grant_of(st: StepState, rid: str, lease: int) -> str:
    """The grant of the job an instance runs under `lease`: the table's while that lease is
    the request's (a delta under an older one is stale whatever it carries)."""
    r = st.table.requests[rid]
    return r.grant if r.lease == lease else ""


def prompt_of(rid: str) -> int:
    """The prompt index a request id names (`core.request_state.request_id`)."""
    return int(rid.split(":")[1])

"""The step controller: what is decided for one step in flight, as a pure object (vLLM v1's
scheduler model: one object decides, one loop carries its decisions out). Two kinds of event
come in:
- a read of token deltas (`update_from_deltas`): applied to the step's `RequestTable` by
  `core.collect.apply_batches`; out comes a `CollectOutcome` (requests to store, continuation
  jobs to queue, responses to score, stale leases to fence, groups quarantined);
  `route_deltas` splits a read among the steps in flight;
- a tick (`tick`): heartbeats, the step's unfinished requests (every shard's), each worker's
  executing requests and a monotonic clock; out come `Actions`: the orders to send workers
  (pause, resume, release), the seeding window's end to record, the read cap to publish.
No Redis: the coordinator's shells (`delta_collector.py`, `scheduling.py`) read what goes in and
write each decision in one MULTI. Every coordinator shard holds one per step for its deltas; the
leader (shard 0) also ticks it. The simulator drives the same object: its flushes go through
`update_from_deltas` and its balancing through `balance`.

Seeding (`core.seeding`): the reserved pool generates for the step's window T_seed, counted from
when a reserved worker first holds a version that may generate the step, then steps aside
(pause); with no preemptible worker left while requests remain, it is recalled (resume).
Balancing (`core.balancer`): with fair reads every worker's cap is an equal share of what is
executing, and a worker over its cap is ordered to release the excess, at most once per
cooldown.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.contracts.messages import DeltaBatch, Heartbeat, WorkerControl
from services.core.balancer import ReleaseGate, WorkerLoad, equal_caps, read_cap, releases
from services.core.collect import CollectOutcome, CollectRules, apply_batches, split_by_step
from services.core.request_table import RequestTable
from services.core.seeding import recall, seeding_over


def serving(beats: dict[str, Heartbeat], run_id: str, step: int) -> int:
    """The workers that serve the step's version or will once they have loaded it: alive on
    the run or idle (an idle worker follows the active run), not failed, not stepped aside for
    this version."""
    return sum(
        1
        for b in beats.values()
        if b.run_id in (run_id, None) and not b.error and not (b.paused and b.version == step)
    )


def balance_orders(
    loads: list[WorkerLoad], queued: int, fair_reads: bool, gate: ReleaseGate, now: float
) -> tuple[dict[str, int], list[float]]:
    """Algorithm 2: how many requests each worker is ordered to release now (onto equal shares
    with fair reads), and when each release held back by the cooldown is due."""
    if fair_reads:
        loads = equal_caps(loads)
    return gate.due(releases(loads, queued), now)


@dataclass
class Actions:
    """What one decision of the controller asks for, carried out in this order."""

    orders: list[tuple[str, WorkerControl]] = field(default_factory=list)  # (worker, order)
    seed_end: float | None = None  # the seeding window is over at this time: record it
    read_cap: int | None = None  # publish the step's read cap
    paused: int = 0  # reserved workers told to step aside (for the log)
    recalled: bool = False  # the reserved pool is called back to the step
    resumed: int = 0  # reserved workers told to resume (for the log)
    released: dict[str, int] = field(default_factory=dict)  # release orders (for the log)


@dataclass
class StepController:
    """One step in flight: its request table and the run's rules for moving requests; on the
    leader, its seeding window, recall, read cap and load balancing too."""

    table: RequestTable
    rules: CollectRules = field(default_factory=CollectRules)
    fair_reads: bool = True  # publish the read cap and balance onto equal shares (RunSpec)
    staleness: int = 0  # max_staleness: workers holding versions step - k .. step serve it
    window_s: float = 0.0  # the seeding window, set by `start`
    started: float = 0.0  # monotonic, when the step began; set by `start`
    seed_start: float | None = None  # when a reserved worker first held the step's weights
    seeded_out: bool = False
    seed_end: float | None = None
    recalled: float | None = None  # when the reserved pool was called back to the step
    release_gate: ReleaseGate = field(default_factory=ReleaseGate)

    @property
    def run_id(self) -> str:
        return self.table.run_id

    @property
    def step(self) -> int:
        return self.table.step

    def update_from_deltas(self, batches: list[DeltaBatch]) -> CollectOutcome:
        """A read's batches of this step, in read order: applied to the request table (fenced
        by lease, appended once); what the shell must store, queue, score and fence."""
        return apply_batches(self.table, batches, self.rules)

    def balance(
        self, loads: list[WorkerLoad], queued: int, now: float
    ) -> tuple[dict[str, int], list[float]]:
        """Release orders for workers over their cap (`balance_orders`, with this step's
        cooldown), and when each one held back is due."""
        return balance_orders(loads, queued, self.fair_reads, self.release_gate, now)

    def start(
        self,
        workers: dict[str, Heartbeat],
        seed_done: bool,
        window_s: float,
        started: float,
        now: float,
    ) -> Actions:
        """The step is opened (at `started`, monotonic) with the workers alive on the run and
        a seeding window of `window_s`; `seed_done` when its window was over before a
        restart."""
        self.window_s, self.started = window_s, started
        if seed_done:
            self.seeded_out, self.seed_end = True, self.started  # a resumed step: already over
            return Actions()
        if not any(b.pool == "reserved" for b in workers.values()):
            return self._end_seeding({}, now)  # nothing to seed with: the trainer may start
        return Actions()

    def tick(
        self,
        now: float,
        unfinished: int,
        beats: dict[str, Heartbeat],
        executing: dict[str, int],
        pending: int,
    ) -> Actions:
        """One pass, given the step's unfinished requests (every shard's), every alive
        worker's heartbeat, the jobs each reader of the step's stream holds and their total."""
        workers = {w: b for w, b in beats.items() if b.run_id == self.run_id}
        reserved = [b for b in workers.values() if b.pool == "reserved"]
        if self.seed_start is None and any(self._serves(b) for b in reserved):
            self.seed_start = now  # the window runs from when seeding can start
        n_preemptible = sum(1 for b in workers.values() if b.pool == "preemptible")
        out = Actions()
        if not self.seeded_out and seeding_over(
            now, self.seed_start, self.window_s, len(reserved), n_preemptible
        ):
            out = self._end_seeding(workers, now)
        if self.recalled is None and recall(self.seeded_out, n_preemptible, unfinished):
            self._recall(reserved, now, out)
        if self.fair_reads:
            out.read_cap = read_cap(unfinished, serving(beats, self.run_id, self.step))
        loads = [
            WorkerLoad(w, executing.get(w, 0), b.plateau or b.slots)
            for w, b in workers.items()
            if b.version == self.step and not b.paused and not b.error
        ]
        wanted, _ = self.balance(loads, unfinished - pending, now)
        for worker_id, count in wanted.items():
            order = WorkerControl(action="release", run_id=self.run_id, count=count)
            out.orders.append((worker_id, order))
        out.released = wanted
        return out

    def finish(self, now: float) -> Actions:
        """Rollout is over; with no preemptible pool the reserved one did it all."""
        if self.seeded_out:
            return Actions()
        out = self._end_seeding({}, now)
        self.seed_end = None  # the window never closed during the step
        return out

    def _serves(self, beat: Heartbeat) -> bool:
        """Whether the worker holds a version that may generate this step."""
        return beat.version is not None and self.step - self.staleness <= beat.version <= self.step

    def _end_seeding(self, workers: dict[str, Heartbeat], now: float) -> Actions:
        out = Actions()
        for worker_id, b in workers.items():
            if b.pool == "reserved" and b.version is not None and self._serves(b):
                pause = WorkerControl(action="pause", run_id=self.run_id, version=b.version)
                out.orders.append((worker_id, pause))
                out.paused += 1
        self.seeded_out, self.seed_end = True, now
        out.seed_end = now
        return out

    def _recall(self, reserved: list[Heartbeat], now: float, out: Actions) -> None:
        """No preemptible worker is left: the reserved workers resume the step."""
        self.recalled = now
        for beat in reserved:
            # paused at the version it holds (one step's, or an earlier one in flight)
            version = self.step if not self.staleness else (beat.version or 0)
            resume = WorkerControl(action="resume", run_id=self.run_id, version=version)
            out.orders.append((beat.worker_id, resume))
        out.recalled, out.resumed = True, len(reserved)


def route_deltas(
    steps: Mapping[int, StepController], batches: list[DeltaBatch]
) -> tuple[list[tuple[StepController, CollectOutcome]], int]:
    """One read of a run's deltas, split by step (`collect.split_by_step`) and applied to the
    steps in flight; and the delta items of steps not in flight (finished, or
    fenced stragglers), which nothing applies any more."""
    out, unknown = [], 0
    for step, part in split_by_step(batches).items():
        control = steps.get(step)
        if control is None:
            unknown += sum(len(b.items) for b in part)
            continue
        out.append((control, control.update_from_deltas(part)))
    return out, unknown

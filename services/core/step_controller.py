"""The step controller: THE one decider of a step in flight, as a pure object (vLLM v1's
scheduler model: one object decides and returns an output that carries every decision; a short
loop carries it out). It takes every event of a step, in order, and each returns one complete
`Effects` value that the coordinator's shell (`coordinator/step/loop.py`,
`coordinator/step/deltas.py`) writes, in one MULTI where it is one decision
(`coordinator/step/store.py`):

- `open`: the step is queued or restored: its first jobs, the read cap queued with them, the
  start of its seeding window (or its end at once, with no reserved worker to seed with);
- `on_deltas`: a read of the step's token deltas, applied to its `RequestTable` by
  `core.collect.apply_batches`: requests to store, continuation jobs to queue, responses to
  score, turns for the environment, stale leases to fence, groups completed (to publish) or
  quarantined; `route_deltas` splits a read among the steps in flight;
- `on_scores` / `on_answers`: the rewards of finished responses; the environment's answers to
  ended turns (next turns' jobs, episodes over and the groups they complete);
- `tick`: heartbeats, every shard's unfinished requests, what each worker executes, a clock:
  the seeding window's end, the recall, the read cap, release orders (balancing), which dead
  readers' jobs to reclaim, and (for the step the trainer waits for) the stall check;
- `on_claimed`: the jobs claimed from a dead reader: which requests continue where;
- `end`: the rollout is over: the seeding window's end if it never closed, the run is no longer
  stalled, the step's times, and the verdict on its failed calls of user code;
- `stored`: the shell wrote an effects value: its groups are published from then on.

What is the whole run's rather than one step's (the seeding controller, Algorithm 1; the pool
sizer; the stall tracker and the workers seen on the run) is a `Lead`, which the leader's
controllers share (None on a follower shard: it decides only its own requests' fate). After
the trainer committed a step, `Lead.trained` moves T_seed and sizes the preemptible pool.

Which workers serve step s has ONE definition, `serves`: alive on the run (or idle, following
the active run), not failed, and not stepped aside for a version that may generate the step
(with max_staleness k, versions s - k .. s do). Of those, the ones that hold such a version now
(`holds`) are seeded, paused and balanced.

The simulator (`services/sim`) drives the same object through the events it models: `open`,
`on_deltas`, `on_answers` with `stored`, `tick` (the seeding window's end and the recall of
synchronous steps; it balances through `balance` itself), `on_claimed` and `end`.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.contracts.messages import DeltaBatch, Heartbeat, Job, WorkerControl
from services.core.balancer import ReleaseGate, WorkerLoad, equal_caps, read_cap, releases
from services.core.call_errors import CallCount, judge
from services.core.collect import CollectOutcome, CollectRules, apply_batches, split_by_step
from services.core.episodes import EpisodeTable
from services.core.reclaim import expired_readers, plan_reclaim
from services.core.request_table import RequestTable
from services.core.seeding import (
    PoolSizer,
    SeedingController,
    SeedingUpdate,
    StepTimes,
    after_step,
    recall,
    seeding_over,
)
from services.core.stall import Action, Decision, GoneWorker, StallTracker, WorkerView, blocker

GONE_KEPT = 20  # workers gone from the run that a stall reason can name, newest first


def holds(beat: Heartbeat, step: int, staleness: int) -> bool:
    """Whether the worker holds a version that may generate `step` (s - k .. s)."""
    return beat.version is not None and step - staleness <= beat.version <= step


def serves(beat: Heartbeat, run_id: str, step: int, staleness: int = 0) -> bool:
    """THE definition of a worker that serves step `step` of the run, or will once it has
    loaded its weights: alive on the run or idle (an idle worker follows the active run), not
    failed, not stepped aside (paused) holding a version that may generate the step. A worker
    serving several runs is read as it serves `run_id` (`Heartbeat.serving`)."""
    view = beat if beat.run_id is None else beat.serving(run_id)
    return (
        view is not None and not view.error and not (view.paused and holds(view, step, staleness))
    )


def serving(beats: dict[str, Heartbeat], run_id: str, step: int, staleness: int = 0) -> int:
    """How many workers serve the step (`serves`)."""
    return sum(1 for b in beats.values() if serves(b, run_id, step, staleness))


def pools_of(workers: dict[str, Heartbeat]) -> dict[str, int]:
    """The workers of each pool."""
    counts = {"reserved": 0, "preemptible": 0}
    for beat in workers.values():
        counts[beat.pool] += 1
    return counts


def room_for_run(beat: Heartbeat, ours: Heartbeat) -> int:
    """The requests a worker could hold of one run (`ours`: its beat as that run reads it):
    its plateau (or slots), less what it holds of the other runs it serves at once."""
    return max(0, (beat.plateau or beat.slots) - (beat.active - ours.active))


def balance_orders(
    loads: list[WorkerLoad], queued: int, fair_reads: bool, gate: ReleaseGate, now: float
) -> tuple[dict[str, int], list[float]]:
    """Algorithm 2: how many requests each worker is ordered to release now (onto equal shares
    with fair reads), and when each release held back by the cooldown is due."""
    if fair_reads:
        loads = equal_caps(loads)
    return gate.due(releases(loads, queued), now)


@dataclass
class Effects:
    """Everything one event of a step decided, carried out by the shell in this order: stored
    (requests, episodes, the step's mark), queued (jobs), handed, acknowledged, published,
    quarantined, ordered (fences, worker orders), the read cap and the seeding window's end;
    then counted, told and logged."""

    rows: set[str] = field(default_factory=set)  # requests whose stored state changed
    episodes: set[str] = field(default_factory=set)  # multi-turn episodes that changed
    queued_at: float | None = None  # the step's first jobs (unix s): its mark, every state
    jobs: list[Job] = field(default_factory=list)  # to queue on the step's stream, in order
    migrated: dict[str, int] = field(default_factory=dict)  # cause -> requests moved
    handed: dict[int, DeltaBatch] = field(default_factory=dict)  # shard -> releases (reclaim)
    acks: list[Any] = field(default_factory=list)  # claimed entries to acknowledge (reclaim)
    drop_reader: str | None = None  # a dead reader's consumer to delete (reclaim)
    dead_worker: str | None = None  # a worker declared dead (reclaim)
    publish: list[int] = field(default_factory=list)  # groups complete: to the trainer
    dropped: list[int] = field(default_factory=list)  # groups quarantined
    poisoned: list[tuple[str, str]] = field(default_factory=list)  # (request, last worker)
    poison_fails: bool = False  # poison fails the run (on_poison=fail_run)
    fences: dict[str, set[tuple[str, int]]] = field(default_factory=dict)  # worker -> to drop
    score: list[str] = field(default_factory=list)  # finished responses: to score
    turns: list[str] = field(default_factory=list)  # ended turns: for the environment
    orders: list[tuple[str, WorkerControl]] = field(default_factory=list)  # (worker, order)
    read_cap: int | None = None  # publish the step's read cap
    seed_end: float | None = None  # the seeding window is over at this time: record it
    reclaim: list[str] = field(default_factory=list)  # dead readers whose jobs to claim
    stall: Decision | None = None  # the run's stall state changes
    resumed_why: str = ""  # what a stall's RESUME says
    times: StepTimes | None = None  # the step's times (at its end)
    fail: str | None = None  # the run fails with this reason
    read: CollectOutcome | None = None  # the read's counters (metrics)
    paused: int = 0  # reserved workers told to step aside (for the log)
    recalled: bool = False  # the reserved pool is called back to the step
    resumed: int = 0  # reserved workers told to resume (for the log)
    released: dict[str, int] = field(default_factory=dict)  # release orders (for the log)
    # the Redis primary the step's state is written on from now on, recorded with it (None:
    # nothing to record): a step restored on another one moved every request on
    primary: str | None = None

    def merge(self, other: "Effects") -> "Effects":
        """This value and `other` (the answers to its turns, or a reclaim), decided after it,
        as one (for one write)."""
        self.rows |= other.rows
        self.episodes |= other.episodes
        self.jobs.extend(other.jobs)
        for cause, n in other.migrated.items():
            self.migrated[cause] = self.migrated.get(cause, 0) + n
        self.publish = sorted(set(self.publish) | set(other.publish))
        self.orders.extend(other.orders)
        return self

    @property
    def writes(self) -> bool:
        """Whether anything is to be written to Redis."""
        return bool(
            self.rows
            or self.episodes
            or self.queued_at is not None
            or self.jobs
            or self.handed
            or self.acks
            or self.drop_reader
            or self.publish
            or self.dropped
            or self.fences
            or self.orders
            or self.read_cap is not None
            or self.seed_end is not None
            or self.primary is not None
        )


@dataclass
class Tick:
    """What a tick of the leader reads: the clocks, every alive worker's heartbeat, the other
    shards' unfinished requests, the jobs each reader of the step's stream holds (and whether
    its heartbeat key is there), and for the stall check the trainer's committed version,
    whether this is the step the trainer waits for and the workers gone from the run."""

    now: float  # monotonic
    wall: float  # unix s (a stall restored after a restart keeps its start)
    beats: dict[str, Heartbeat]
    others_unfinished: int = 0
    executing: dict[str, int] = field(default_factory=dict)  # reader's worker -> jobs held
    pending: int = 0  # the jobs held by every reader
    readers: dict[str, int] = field(default_factory=dict)  # consumer name -> jobs pending
    beating: set[str] = field(default_factory=set)  # readers whose heartbeat key exists
    committed: int = 0
    oldest: bool = True  # the step the trainer waits for
    gone: list[GoneWorker] = field(default_factory=list)


@dataclass
class Lead:
    """What the leader decides for the whole run, shared by its steps' controllers: the
    seeding window (Algorithm 1), the pool to hold, the stall state and the workers seen."""

    seeding: SeedingController = field(default_factory=SeedingController)
    pool: PoolSizer = field(default_factory=lambda: PoolSizer(0.0))
    stall: StallTracker = field(default_factory=lambda: StallTracker(3.0))
    max_error_share: float = 1.0  # the share of failed user-code calls that fails the run
    seen: dict[str, float] = field(default_factory=dict)  # worker seen on the run -> unix s

    def restore(self, stalled_since: float | None, reason: str, loaded: list[str]) -> None:
        """After a restart: a stall recorded before it, and the workers that loaded the run."""
        if stalled_since is not None:
            self.stall.restore(stalled_since, reason)
        self.seen |= {w: 0.0 for w in loaded}

    def window(self, pools: dict[str, int], staleness: int) -> float:
        """The seeding window of a step opened with these pools (asynchronous: the reserved
        pool trains; no window, it is recalled as ever when no preemptible worker is left)."""
        return 0.0 if staleness else self.seeding.window_s(pools["preemptible"])

    def gone_ids(self, beats: dict[str, Heartbeat]) -> list[str]:
        """The workers seen on the run and gone now, the newest first (a stall reason's)."""
        gone = (w for w in self.seen if w not in beats)
        return sorted(gone, key=self.seen.__getitem__, reverse=True)[:GONE_KEPT]

    def trained(self, times: StepTimes) -> tuple[SeedingUpdate, int | None]:
        """The trainer committed the version trained on a step of these times: T_seed moved,
        N_prem recommended, and the pool a scaler should hold."""
        update = after_step(self.seeding, times)
        return update, self.pool.after_step(update.n_prem_recommended)


@dataclass
class StepController:
    """One step in flight: its request table and the run's rules for moving requests; on the
    leader (`lead` set), its seeding window, recall, read cap, balancing, reclaim and stall
    check too."""

    table: RequestTable
    rules: CollectRules = field(default_factory=CollectRules)
    fair_reads: bool = True  # publish the read cap and balance onto equal shares (RunSpec)
    staleness: int = 0  # max_staleness: workers holding versions step - k .. step serve it
    lead: Lead | None = None  # the leader's: the whole step's decisions are this one's
    migration: bool = True  # token-level migration (a reclaim keeps the tokens)
    # the reserved pool starts each step stepped aside and generates only for a window (a node
    # that trains between steps, as the simulator's): with a zero window it never seeds, so
    # seeding is over at `open`
    starts_aside: bool = False
    # at its window's end the reserved pool steps aside even with no preemptible worker to take
    # over, and the recall calls it back at once (the simulator's rule; `seeding_over`)
    aside_alone: bool = False
    # the tick orders releases (Algorithm 2 over the step's workers); False where the shell
    # balances through `balance` itself (the simulator: over all its steps, after every event)
    balances: bool = True
    window_s: float = 0.0  # the seeding window, set by `open`
    started: float = 0.0  # monotonic, when the step began; set by `open`
    pools: dict[str, int] = field(default_factory=lambda: {"reserved": 0, "preemptible": 0})
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

    def serves(self, beat: Heartbeat) -> bool:
        return serves(beat, self.run_id, self.step, self.staleness)

    def holds(self, beat: Heartbeat) -> bool:
        return holds(beat, self.step, self.staleness)

    # -- open --------------------------------------------------------------------------------

    def open(
        self,
        beats: dict[str, Heartbeat],
        started: float,
        now: float,
        queued_at: float | None = None,
        seed_done: bool = False,
        primary: str = "",
        written_on: str = "",
    ) -> Effects:
        """The step is opened at `started` (monotonic) with these alive workers: queued now
        (`queued_at`, unix s: its first jobs, and on the leader with fair reads the read cap,
        so that the first worker to hold the version never reads more than its share) or
        restored (None). `seed_done` when its seeding window was over before a restart.
        `primary`: the Redis primary written on now ("" for a plain Redis); `written_on`: the
        one a restored step's state was written on (`_failed_over` where they differ)."""
        workers = {w: v for w, b in beats.items() if (v := b.serving(self.run_id)) is not None}
        self.pools, self.started = pools_of(workers), started
        out = Effects(queued_at=queued_at)
        if queued_at is not None:
            out.jobs = self.table.initial_jobs()
            out.primary = primary or None
        else:
            self._restored(out)
            if written_on != primary:
                self._failed_over(out, primary)
        if self.lead is None:
            return out
        self.window_s = self.lead.window(self.pools, self.staleness)
        if queued_at is not None and self.fair_reads:
            step_requests = len(self.table.prompts) * self.table.group_size  # every shard's
            out.read_cap = read_cap(
                step_requests, serving(beats, self.run_id, self.step, self.staleness)
            )
        if seed_done:
            self.seeded_out, self.seed_end = True, started  # a resumed step: already over
        elif not any(b.pool == "reserved" for b in workers.values()):
            self._end_seeding({}, now, out)  # nothing to seed with: the trainer may start
        elif self.starts_aside and self.window_s == 0:
            self._end_seeding({}, now, out)  # no window: the reserved pool stays aside
        return out

    def _restored(self, out: Effects) -> None:
        """A step restored after a restart: its finished responses are scored again (a
        finished episode holds its rewards), its turns that waited for the environment are
        answered now (an environment is a function of the row and the history)."""
        table = self.table
        if isinstance(table, EpisodeTable):
            awaiting = table.awaiting()
            out.rows, out.episodes, out.turns = set(awaiting), set(awaiting), awaiting
            return
        out.score = [rid for rid, req in table.requests.items() if req.done]

    def _failed_over(self, out: Effects, primary: str) -> None:
        """Restored from another Redis primary than the one the step's state was written on:
        a failover, and replication is asynchronous, so this one may lack the old one's last
        writes (tokens stored, jobs handed out, leases moved). Every unfinished request moves
        to a new lease, continuing from the tokens this primary holds: whatever a worker made
        of a job or a lease that was lost is fenced off (its deltas carry an old lease)."""
        table = self.table
        moved = [job for rid in table.unfinished() if (job := table.migrate(rid, "failover"))]
        out.rows |= {job.request_id for job in moved}
        out.jobs.extend(moved)
        out.migrated["failover"] = len(moved)
        out.primary = primary

    # -- a read of deltas, its scores, the environment's answers --------------------------

    def update_from_deltas(self, batches: list[DeltaBatch]) -> CollectOutcome:
        """A read's batches of this step applied to the request table (fenced by lease,
        appended once), as `core.collect` says."""
        return apply_batches(self.table, batches, self.rules)

    def on_deltas(self, batches: list[DeltaBatch]) -> Effects:
        """A read's batches of this step, in read order: what to store, queue, score, answer,
        fence, publish and quarantine."""
        outcome = self.update_from_deltas(batches)
        jobs = [job for moved in outcome.released.values() for job in moved]
        return Effects(
            rows=outcome.changed,
            episodes=set(outcome.turn_ended),
            jobs=jobs,
            migrated={cause: len(moved) for cause, moved in outcome.released.items()},
            publish=self.table.completed_groups(outcome.finished),
            dropped=outcome.dropped,
            poisoned=outcome.poisoned,
            poison_fails=not self.rules.drop_poison,
            fences=outcome.stale,
            score=outcome.finished,
            turns=outcome.turn_ended,
            read=outcome,
        )

    def on_scores(self, rewards: dict[str, float]) -> None:
        """The rewards of finished responses (scored by the shell's reward runner)."""
        self.table.score(rewards)

    def on_answers(self, jobs: list[Job], over: list[str]) -> Effects:
        """The environment answered ended turns: the next turns' jobs, and the episodes over
        (scored by their turns' rewards) with the groups they complete."""
        return Effects(jobs=list(jobs), publish=self.table.completed_groups(over))

    def stored(self, effects: Effects) -> None:
        """The shell wrote `effects`: their groups are published from now on."""
        self.table.mark_published(effects.publish)

    # -- the leader's tick -------------------------------------------------------------------

    def tick(self, t: Tick) -> Effects:
        """One pass of the leader over the step: seeding, recall, read cap, balancing, the dead
        readers to reclaim and (for the step the trainer waits for) the stall check."""
        out = Effects(reclaim=self.dead_readers(t.readers, t.beating))
        unfinished = self.table.unfinished_count + t.others_unfinished
        workers = {w: v for w, b in t.beats.items() if (v := b.serving(self.run_id)) is not None}
        reserved = [b for b in workers.values() if b.pool == "reserved"]
        if self.seed_start is None and any(self.holds(b) for b in reserved):
            self.seed_start = t.now  # the window runs from when seeding can start
        n_preemptible = sum(1 for b in workers.values() if b.pool == "preemptible")
        if not self.seeded_out and seeding_over(
            t.now, self.seed_start, self.window_s, len(reserved), n_preemptible, self.aside_alone
        ):
            self._end_seeding(workers, t.now, out)
        if self.recalled is None and recall(self.seeded_out, n_preemptible, unfinished):
            self._recall(reserved, t.now, out)
        if self.fair_reads:
            out.read_cap = read_cap(
                unfinished, serving(t.beats, self.run_id, self.step, self.staleness)
            )
        if self.balances:
            self._balance(workers, t, unfinished, out)
        if t.oldest and self.lead is not None:
            self._check_stall(t, out)
        return out

    def balance(
        self, loads: list[WorkerLoad], queued: int, now: float
    ) -> tuple[dict[str, int], list[float]]:
        """Release orders for workers over their cap (`balance_orders`, with this step's
        cooldown), and when each one held back is due."""
        return balance_orders(loads, queued, self.fair_reads, self.release_gate, now)

    def _balance(
        self, workers: dict[str, Heartbeat], t: Tick, unfinished: int, out: Effects
    ) -> None:
        """Release orders for the workers that serve the step and hold its weights now."""
        loads = [
            WorkerLoad(w, t.executing.get(w, 0), room_for_run(t.beats[w], b))
            for w, b in workers.items()
            if self.serves(b) and self.holds(b)
        ]
        wanted, _ = self.balance(loads, unfinished - t.pending, t.now)
        for worker_id, count in wanted.items():
            order = WorkerControl(action="release", run_id=self.run_id, count=count)
            out.orders.append((worker_id, order))
        out.released = wanted

    def _check_stall(self, t: Tick, out: Effects) -> None:
        """Whether a worker can serve the version the trainer waits for; the run's stall state
        as it changes (raised as `fail` once stalled past its timeout)."""
        assert self.lead is not None
        version = min(self.step, t.committed)
        alive = []
        for worker_id, beat in t.beats.items():
            ours = beat.serving(self.run_id)
            if ours is not None:
                self.lead.seen[worker_id] = t.wall
            aside = ours is not None and ours.paused and holds(ours, version, self.staleness)
            alive.append(WorkerView(worker_id, (ours or beat).version, aside, beat.error))
        decision = self.lead.stall.observe(t.wall, blocker(version, alive, t.gone))
        if decision.action is not Action.NONE:
            out.stall, out.resumed_why = decision, f"a worker can serve version {version}"
        if decision.action is Action.FAIL:
            out.fail = decision.reason

    # -- reclaim -------------------------------------------------------------------------------

    def dead_readers(self, readers: dict[str, int], beating: set[str]) -> list[str]:
        """The readers of the step's stream (name -> jobs pending) whose jobs to reclaim: they
        hold jobs and their heartbeat expired (not `beating`)."""
        return expired_readers(readers, beating)

    def on_claimed(self, reader: str, ids: list[Any], jobs: list[Job], claimer: str) -> Effects:
        """The jobs claimed from a dead `reader` (entries `ids`): each request migrates under
        the lease its job carried, here or on the shard that holds it (`core.reclaim`)."""
        plan = plan_reclaim(self.table, reader, jobs, self.migration, claimer)
        return Effects(
            rows={job.request_id for job in plan.moved},
            jobs=plan.moved,
            migrated={"death": len(plan.moved)},
            handed=plan.handed,
            acks=list(ids),
            drop_reader=reader if plan.dead else None,
            dead_worker=reader if plan.dead else None,
        )

    # -- the step's end ------------------------------------------------------------------------

    def end(self, now: float, wall: float, calls: Mapping[str, CallCount] | None = None) -> Effects:
        """The rollout is over (at `now`, monotonic): with no preemptible pool the reserved
        one did it all; the run progressed (not stalled); the step's times; and on the leader
        the verdict on the whole step's `calls` of user code (too many failed fail the run)."""
        out = Effects()
        if self.lead is not None and not self.seeded_out:
            self._end_seeding({}, now, out)
            self.seed_end = None  # the window never closed during the step
        out.times = StepTimes(
            n_preemptible=self.pools["preemptible"],
            n_reserved=self.pools["reserved"],
            started=self.started,
            seed_end=self.seed_end,
            rollout_end=now,
            committed=float("nan"),
            train_compute_s=float("nan"),
            train_wait_s=float("nan"),
        )
        if self.lead is None:
            return out
        decision = self.lead.stall.observe(wall, None)
        if decision.action is not Action.NONE:
            out.stall, out.resumed_why = decision, f"step {self.step} rolled out"
        verdict = judge(calls or {}, self.lead.max_error_share, f"in step {self.step}")
        if verdict.health == "failed":
            out.fail = verdict.reason
        return out

    def _end_seeding(self, workers: dict[str, Heartbeat], now: float, out: Effects) -> None:
        for worker_id, b in workers.items():
            if b.pool == "reserved" and b.version is not None and self.holds(b):
                pause = WorkerControl(action="pause", run_id=self.run_id, version=b.version)
                out.orders.append((worker_id, pause))
                out.paused += 1
        self.seeded_out, self.seed_end = True, now
        out.seed_end = now

    def _recall(self, reserved: list[Heartbeat], now: float, out: Effects) -> None:
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
) -> tuple[list[tuple[StepController, Effects]], int]:
    """One read of a run's deltas, split by step (`collect.split_by_step`) and applied to the
    steps in flight (`StepController.on_deltas`); and the delta items of steps not in flight
    (finished, or fenced stragglers), which nothing applies any more."""
    out, unknown = [], 0
    for step, part in split_by_step(batches).items():
        control = steps.get(step)
        if control is None:
            unknown += sum(len(b.items) for b in part)
            continue
        out.append((control, control.on_deltas(part)))
    return out, unknown

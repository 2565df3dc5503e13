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

The step side is here: the event loop, starting a step, the reserved node's seeding window and
recall, the trainer consuming groups as they arrive, the version commit and the T_seed update.
Each step is decided by the coordinator's own `StepController`, driven through the events this
simulation models, as the services drive it (docs/design.md 5g): `open` (the first jobs, the
pools, the window from a `Lead` whose `seeding` is this simulation's `SeedingController`),
`on_deltas`, `on_answers` and `stored` (requests.py), after every event a `tick` of each
synchronous step rolling out (the instances' heartbeats: the window's end and the recall,
whose pause and resume orders are carried out here), `on_claimed` for a dead instance's jobs
(instances.py, requests.py), and `end` (the step's times, the trainer's filled in at the
commit, then `seeding.after_step`: Algorithm 1 and N_prem). What is modelled here is time: the
node's switches between training and rollout, the trainer's micro-batches as groups arrive,
one optimizer step, the publication. Under asynchronous RL the trainer takes the oldest step's
groups only (it is sequential); later steps' groups wait for their turn, and the reserved node
does not seed (window 0): it trains, and generates only when recalled, which stays this
simulation's (`recall_async`: the node shares its GPUs with the trainer, so it is called back
only while the trainer has nothing to do, and again after it stepped back to train).

Two components hold the rest, each owning its events (the loop maps an event's kind to its
owner's method): the instances (`Fleet`, instances.py, as `sim.fleet`) and the requests with
the turns of multi-turn episodes (`RequestFlow`, requests.py, as `sim.requests`). They share
the `Clock` (clock.py): the time, the latest committed version and the events to come.
"""

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from services.contracts.runspec import RolloutSection
from services.core.collect import CollectRules
from services.core.request_table import request_id
from services.core.seeding import (
    PoolSizer,
    SeedingController,
    StepTimes,
    after_step,
    recall,
    recommended_pool_size,
    train_compute_s,
)
from services.core.step_controller import Effects, Lead, StepController, Tick
from services.sim.clock import Clock
from services.sim.instances import Fleet, reserved_instances
from services.sim.requests import RequestFlow
from services.sim.scenario import Scenario
from services.sim.state import Instance, StepRecord, StepState, Totals
from services.sim.systems import SystemSpec
from services.sim.tail import expected_lengths
from services.sim.turns import step_table, turn_physics

QUANTUM_S = 5.0  # the longest an engine runs at one step rate (contexts grow meanwhile)


class Simulation:
    """One system on one trace: the clock's loop and the step side, with the instances
    (`fleet`) and the requests (`requests`) as components."""

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
        self.clock = Clock()
        self.totals = Totals()
        self.cur: StepState | None = None  # the oldest step in flight: the one the trainer takes
        self.inflight: dict[int, StepState] = {}  # steps queued and not committed, oldest first
        self.resuming = False  # the reserved engines are switching to rollout (a recall)
        self.trainer_back_s = 0.0  # asynchronous RL: the node trains again from then
        # asynchronous RL: the pool's and the reserved engines' rollout busy seconds at the commit
        self.busy_mark = (0.0, 0.0)
        self.records: list[StepRecord] = []
        instances = reserved_instances(scenario, system)
        self.requests = RequestFlow(
            self.clock, scenario, system, self.totals, self.inflight, instances, self.group_done
        )
        self.fleet = Fleet(
            self.clock, scenario, system, self.totals, seed, instances, self.requests
        )
        self.handlers = self.event_handlers()
        # the window each step opens with (`Lead.window`): off, none while a preemptible
        # instance is up (the reserved node stays aside and trains); co-located, an unbounded
        # one (it generates the whole step)
        t_seed = {"adaptive": scenario.initial_t_seed_s, "off": 0.0, "colocated": math.inf}
        self.rules = CollectRules(migration=system.migration)
        headroom = system.pool_headroom
        # None: the pool holds every instance the trace offers
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
        self.lead = Lead(seeding=self.seeding)  # the leader's: T_seed adapts in `seeding`
        if system.pool == "trace":
            for at, count in targets:
                self.clock.at(at, "target", count)
        elif system.pool == "fixed":
            self.clock.at(0.0, "target", system.fixed_instances)

    def event_handlers(self) -> dict[str, Callable[[Any], None]]:
        """Each event's kind -> the method of the component that owns it."""
        fleet, requests = self.fleet, self.requests
        return {
            "target": fleet.on_target,
            "booted": fleet.on_booted,
            "pulled": fleet.on_pulled,
            "fetched": fleet.on_fetched,
            "gone": fleet.on_gone,
            "detected": fleet.on_detected,
            "wake": requests.on_wake,
            "env_answer": requests.on_env_answer,
            "reserved_ready": self.on_reserved_ready,
            "seed_end": self.on_seed_end,
            "recalled": self.on_recalled,
            "trainer_ready": self.on_trainer_ready,
            "trained": self.on_trained,
            "optimized": self.on_optimized,
            "committed": self.on_committed,
            "switched": self.on_switched,
        }

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> "Simulation":
        self.start_steps()
        while self.clock.now < self.horizon_s and not self.finished():
            busy = [i for i in self.fleet.instances.values() if i.engine.running]
            t = min(
                self.clock.next_event_s(),
                min(
                    (self.clock.now + i.engine.next_stop_s(self.clock.now) for i in busy),
                    default=math.inf,
                ),
                self.clock.now + QUANTUM_S if busy else math.inf,
                self.horizon_s,
            )
            if math.isinf(t):
                break  # nothing can happen any more (the trace ended with no instance)
            self.advance(t, busy)
            if self.handle_events() and not self.system.max_staleness:
                self.tick()
            elif self.system.max_staleness and self.system.pool == "trace":
                self.recall_async()
            self.requests.dispatch()
            self.requests.balance()
        return self

    def handle_events(self) -> bool:
        """The events due by now, each by its owner; whether there was one."""
        handled = False
        while (event := self.clock.due()) is not None:
            kind, payload = event
            self.handlers[kind](payload)
            handled = True
        return handled

    def finished(self) -> bool:
        return self.max_steps is not None and len(self.records) >= self.max_steps

    def advance(self, t: float, busy: list[Instance]) -> None:
        """The `busy` engines run to `t`, the time accounted; the requests that ended go on."""
        self._account(t, busy)
        for inst in busy:
            inst.engine.advance(self.clock.now, t)
        self.clock.now = t
        for inst in busy:
            for rid in inst.engine.stopped():
                self.requests.finish_request(inst, rid)

    def _account(self, t: float, busy: list[Instance]) -> None:
        dt = t - self.clock.now
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
            st.queue and st.control.seeded_out and not st.recalled for st in self.inflight.values()
        )
        return waiting and not any(i.has_heartbeat for i in self.fleet.pool_instances())

    def stalled_async(self) -> bool:
        """Asynchronous RL: jobs wait, no preemptible worker is alive, and the reserved node
        neither generates nor has anything to train (then it is recalled: 0 by construction)."""
        return (
            any(st.queue for st in self.inflight.values())
            and not any(i.has_heartbeat for i in self.fleet.pool_instances())
            and not (self.resuming or self.reserved_generating() or self.trainer_has_work())
        )

    def tick(self) -> None:
        """The leader's tick over each synchronous step rolling out (`StepController.tick`,
        the instances' heartbeats read as the coordinator reads them), after every event: its
        seeding window's end and its recall, carried out here. (Between events only requests
        finish, which never ends a window nor calls for a recall.) The tick does not balance:
        `requests.balance` does, after every event and every finished request."""
        for st in list(self.inflight.values()):
            if st.rollout_end_s is not None:
                continue
            now = self.clock.now
            tick = Tick(
                now, now, self.fleet.beats(), committed=self.clock.version, oldest=st is self.cur
            )
            self.carry_out(st, st.control.tick(tick))

    def carry_out(self, st: StepState, effects: Effects) -> None:
        """A tick's orders: at the seeding window's end the reserved engines ordered to pause
        give their requests back and the node switches to training; recalled (no preemptible
        instance left), the engines ordered to resume switch back to the step."""
        if effects.seed_end is not None:
            for name, order in effects.orders:
                if order.action == "pause":
                    inst = self.fleet.instances[name]
                    self.requests.release(inst, len(inst.engine.running), "seed")
            self.step_aside(st)
        if effects.recalled:
            resumed = [(n, o.version) for n, o in effects.orders if o.action == "resume"]
            self.recall_for(st, resumed)

    def recall_for(self, st: StepState, resumed: list[tuple[str, int | None]]) -> None:
        """The reserved engines `resumed` (name, version) switch back to rollout."""
        st.recalled = True
        self.totals.recalls += 1
        self.resuming = True
        self.totals.reserved_switch_s += self.sc.resume_s
        self.clock.at(self.clock.now + self.sc.resume_s, "recalled", (st.step, resumed))

    def recall_async(self) -> None:
        """Asynchronous RL: the reserved node trains; when no preemptible instance is alive,
        jobs wait and the trainer has nothing to do, its engines resume (after a switch) and
        generate, the oldest step first, while the trainer waits (they share the GPUs); they
        step aside again once the oldest step's rollout is complete (`step_aside_async`)."""
        if self.resuming or self.reserved_generating() or self.trainer_has_work():
            return
        n_pool = sum(1 for i in self.fleet.pool_instances() if i.has_heartbeat)
        waiting = [st for st in self.inflight.values() if st.rollout_end_s is None]
        if not any(
            recall(st.control.seeded_out, n_pool, st.table.unfinished_count) for st in waiting
        ):
            return
        for st in waiting:
            st.recalled = True
        self.recall_for(waiting[0], [(i.name, None) for i in self.fleet.reserved()])

    def reserved_generating(self) -> bool:
        return any(not i.paused for i in self.fleet.reserved())

    def on_recalled(self, payload: tuple[int, list[tuple[str, int | None]]]) -> None:
        """The switch is over: the engines resume (at the version their order says;
        asynchronous: at the latest committed)."""
        step, resumed = payload
        self.resuming = False
        if self.system.max_staleness:
            if not self.trainer_has_work():  # (else the switch back would follow at once)
                for inst in self.fleet.reserved():
                    inst.version, inst.paused = self.clock.version, False
            self.train_next()
            return
        if self.cur is None or self.cur.step != step:
            return
        for name, version in resumed:
            inst = self.fleet.instances[name]
            inst.version, inst.paused = version, False

    # -- the steps ---------------------------------------------------------------------------

    @property
    def step_in_flight(self) -> StepState:
        """The current step: there is one from `run`'s first `start_step` on."""
        assert self.cur is not None, "no step in flight before run()"
        return self.cur

    def start_steps(self) -> None:
        """The steps queued at the start: 0 to k (those version 0 is recent enough for)."""
        self.start_step(0)
        for step in range(1, self.system.max_staleness + 1):
            if self.max_steps is None or step < self.max_steps:
                self.start_step(step)

    def start_step(self, step: int) -> None:
        sc = self.sc
        work = sc.workload.step(self.seed, step)
        table = step_table(sc.workload, step, work.prompt_tokens, self.seed, self.totals)
        lengths = {
            request_id(step, p, s): n
            for p, group in enumerate(work.response_tokens)
            for s, n in enumerate(group)
        }
        control = StepController(
            table,
            self.rules,
            self.system.fair_reads,
            staleness=self.system.max_staleness,
            lead=self.lead,
            migration=self.system.migration,
            starts_aside=True,  # the reserved node trains between steps
            aside_alone=True,  # at the window's end, with no spot instance left too
            balances=False,  # `requests.balance`, over every step in flight
        )
        now = self.clock.now
        opened = control.open(self.fleet.beats(), started=now, now=now, queued_at=now)
        st = StepState(step, control, lengths, work.prompt_tokens, deque(opened.jobs))
        st.turn_tokens, st.env_latency_s = turn_physics(step, work)
        if sc.tail.active:
            self.tail_step(st, work.prompt_log_median)
        self.inflight[step] = st
        if self.cur is None or self.cur.step not in self.inflight:
            self.cur = st
        if not self.system.max_staleness:  # (asynchronous: pulled at the commit, see swap)
            for inst in self.fleet.pool_instances():
                if inst.state == "up":
                    self.fleet.pull(inst)
        if opened.seed_end is not None:  # no window: the reserved node stays aside and trains
            self.clock.at(now, "trainer_ready", step)
        else:  # it switches to rollout for the window
            self.totals.reserved_switch_s += sc.resume_s
            self.clock.at(now + sc.resume_s, "reserved_ready", step)

    def tail_step(self, st: StepState, prompt_log_median: list[float]) -> None:
        """The step's long-tail state (tail.py), drawn from (seed, step) alone so that every
        system sees the same: each request's acceptance; from the second epoch, each
        request's expected length, and its queue longest expected first."""
        tail, wl = self.sc.tail, self.sc.workload
        if tail.speculation is not None:
            rng = random.Random(f"{self.seed}:{st.step}:acceptance")
            st.alphas = {rid: tail.speculation.request_alpha(rng) for rid in st.lengths}
            st.spec_rng = random.Random(f"{self.seed}:{st.step}:steps")
        if tail.length_aware and tail.has_history(st.step):
            rng = random.Random(f"{self.seed}:{st.step}:history")
            cap = wl.max_response_tokens
            draws = expected_lengths(
                prompt_log_median, wl.group_size, wl.sigma_sample, cap, tail.length_noise_sigma, rng
            )
            st.expected = {
                request_id(st.step, p, s): n
                for p, group in enumerate(draws)
                for s, n in enumerate(group)
            }
            self.requests.order_queue(st)

    def on_reserved_ready(self, step: int) -> None:
        """The reserved engines hold the step's weights: the next tick starts its seeding
        window (`StepController.tick`), whose end is due `window_s` later."""
        st = self.step_in_flight
        for inst in self.fleet.reserved():
            inst.version, inst.paused = step, False
        if not math.isinf(st.control.window_s):
            self.clock.at(self.clock.now + st.control.window_s, "seed_end", step)

    def on_seed_end(self, _: object) -> None:
        """The seeding window's end is due: the tick after this event ends it
        (`StepController.tick`)."""

    def step_aside(self, st: StepState) -> None:
        """The reserved engines stop generating; the node switches to training."""
        for inst in self.fleet.reserved():
            inst.paused = True
        self.totals.reserved_switch_s += self.sc.switch_s
        self.clock.at(self.clock.now + self.sc.switch_s, "trainer_ready", st.step)

    def group_done(self, st: StepState, prompt: int) -> None:
        st.ready_groups.append(prompt)
        if st.table.complete:
            self.end_rollout(st)
        if self.system.max_staleness and self.reserved_generating() and self.oldest_rolled_out():
            self.step_aside_async()
        self.train_next()

    def end_rollout(self, st: StepState) -> None:
        """The step's last group is complete: the controller's `end` gives its times, and
        ends the seeding window if it never closed (the reserved node generated to the end,
        co-located): the node steps aside then."""
        ended = st.control.end(self.clock.now, self.clock.now)
        st.times = ended.times
        if ended.seed_end is not None:
            self.step_aside(st)

    def step_aside_async(self) -> None:
        """Asynchronous RL, after a recall: the oldest step's rollout is complete, so the
        reserved engines give their requests back and the node switches to training."""
        for inst in self.fleet.reserved():
            self.requests.release(inst, len(inst.engine.running), "seed")
            inst.paused = True
        self.totals.reserved_switch_s += self.sc.switch_s
        self.trainer_back_s = self.clock.now + self.sc.switch_s
        self.clock.at(self.trainer_back_s, "switched")

    def on_switched(self, _: object) -> None:
        self.train_next()

    def oldest_rolled_out(self) -> bool:
        st = self.cur
        return st is not None and st.step in self.inflight and st.rollout_end_s is not None

    def trainer_has_work(self) -> bool:
        """Asynchronous RL: the oldest step in flight has all its groups, or is training or
        being committed: the reserved node is for training."""
        if not self.inflight:
            return False
        st = self.inflight[min(self.inflight)]  # (while it is published, `cur` is the next)
        return st.rollout_end_s is not None or st.training or bool(st.ready_groups)

    # -- the trainer ------------------------------------------------------------------------

    def on_trainer_ready(self, step: int) -> None:
        self.inflight[step].trainer_ready_s = self.clock.now
        self.train_next()

    def train_next(self) -> None:
        """Train the next ready group of the oldest step in flight (the trainer is sequential:
        a later step's groups wait until it is the oldest). Asynchronous RL: not while the
        reserved engines generate or switch back (they share the node)."""
        if self.system.max_staleness and (
            self.resuming or self.reserved_generating() or self.clock.now < self.trainer_back_s
        ):
            return
        st = self.step_in_flight
        if st.trainer_ready_s is None or st.training:
            return
        if not st.ready_groups:
            if st.idle_since_s is None:
                st.idle_since_s = self.clock.now
            return
        if st.idle_since_s is not None:
            st.train_wait_s += self.clock.now - st.idle_since_s
            st.idle_since_s = None
        prompt = st.ready_groups.popleft()
        group = st.table.group(prompt)
        tokens = sum(len(r.token_ids) for r in group)  # observations are context: trained over
        prompts = len(group) * st.prompt_tokens[prompt]
        seconds = (tokens + prompts) / self.trainer_tokens_per_s()
        st.trained_tokens += tokens - sum(n for r in group for _, n in r.observed)
        st.trained_prompt_tokens += prompts
        st.train_s += seconds
        st.training = True
        self.totals.reserved_train_s += seconds
        self.clock.at(self.clock.now + seconds, "trained", st.step)

    def trainer_tokens_per_s(self) -> float:
        nodes = self.system.reserved_nodes
        speedup = (2 * self.sc.reserved_scaling) ** math.log2(nodes) if nodes > 1 else 1.0
        return self.sc.trainer.tokens_per_s * speedup

    def on_trained(self, step: int) -> None:
        st = self.inflight[step]
        st.training = False
        st.trained_groups += 1
        if st.trained_groups < len(st.prompt_tokens):
            self.train_next()
        elif not self.system.max_staleness:
            last = self.sc.trainer.optimizer_s + self.sc.trainer.publish_s
            self.totals.reserved_train_s += last
            self.clock.at(self.clock.now + last, "committed", step)
        elif min(self.inflight) < step:  # the version before is still being published
            st.optimize_waiting = True
        else:
            self.optimize(st)

    def optimize(self, st: StepState) -> None:
        """Asynchronous RL: the optimizer step, then the version is published while the
        trainer goes on with the next step's groups (as the services' trainer does); the next
        optimizer step waits for that commit."""
        self.totals.reserved_train_s += self.sc.trainer.optimizer_s + self.sc.trainer.publish_s
        self.clock.at(self.clock.now + self.sc.trainer.optimizer_s, "optimized", st.step)

    def on_optimized(self, step: int) -> None:
        later = [s for s in self.inflight if s > step]
        if later:
            self.cur = self.inflight[min(later)]
        self.clock.at(self.clock.now + self.sc.trainer.publish_s, "committed", step)
        self.train_next()

    def on_committed(self, step: int) -> None:
        """Version step+1 is in the weight store: adapt T_seed (Algorithm 1), start the next
        (with k > 0: step+1+k; the instances swap to the new version in the background)."""
        st = self.inflight[step]
        assert st.times is not None, "the last group completed before the trainer took it"
        self.clock.version = step + 1
        self.totals.trained += st.trained_tokens
        times = self.trained_times(st.times, st)
        update = after_step(self.seeding, times, adapt=self.system.seeding == "adaptive")
        if self.system.max_staleness:
            update = replace(update, n_prem_recommended=self.n_prem_async(st))
        self.records.append(
            StepRecord(
                step=step,
                start_s=times.started,
                end_s=self.clock.now,
                rollout_s=times.rollout_end - times.started,
                tokens=st.trained_tokens,
                prompt_tokens=st.trained_prompt_tokens,
                train_s=st.train_s,
                t_seed_s=st.control.window_s,
                spot_instances=times.n_preemptible,
                train_wait_s=st.train_wait_s,
                remote_wait_s=update.t_remote_wait_s,
                n_prem_recommended=update.n_prem_recommended,
            )
        )
        del self.inflight[step]
        if self.inflight:
            self.cur = self.inflight[min(self.inflight)]
        if self.pool_sizer is not None:
            self.fleet.want(self.pool_sizer.after_step(update.n_prem_recommended))
        k = self.system.max_staleness
        if k:
            self.swap()
        nxt = step + 1 + k
        if not self.finished() and (self.max_steps is None or nxt < self.max_steps):
            self.start_step(nxt)
        if k:
            if self.cur is not None and self.cur.optimize_waiting:  # its groups all trained
                self.cur.optimize_waiting = False
                self.optimize(self.cur)
            self.train_next()  # the next step's groups may be waiting

    def trained_times(self, times: StepTimes, st: StepState) -> StepTimes:
        """The controller's times of the step (`end`) with the trainer's, now it committed.
        A window that never closed ended with the rollout: the node switched to training
        then, so it seeded until the rollout's end (as the coordinator's metrics row reads it,
        `record.rollout_row`; the controller's own times say None)."""
        seed_end = times.seed_end if times.seed_end is not None else times.rollout_end
        return replace(
            times,
            seed_end=seed_end,
            committed=self.clock.now,
            train_compute_s=st.train_s,
            train_wait_s=st.train_wait_s,
        )

    def n_prem_async(self, st: StepState) -> float:
        """Asynchronous RL: steps overlap, so a step's own rollout time says little. N_prem
        (`recommended_pool_size`) is taken from the rollout work done since the last commit, about
        one step's worth: the pool's busy instance-seconds, and the reserved engines' (when
        recalled), over the step's training compute."""
        pool_busy = sum(
            i.engine.busy_s for i in self.fleet.instances.values() if i.pool == "preemptible"
        )
        reserved_busy = self.totals.reserved_rollout_s
        last_pool, last_reserved = self.busy_mark
        self.busy_mark = (pool_busy, reserved_busy)
        return recommended_pool_size(
            pool_busy - last_pool,
            1,
            reserved_busy - last_reserved,
            len(self.fleet.reserved()),
            train_compute_s(st.train_s, 0.0, 0.0),
        )

    def swap(self) -> None:
        """Asynchronous RL: every up instance pulls the new version in the background (one
        still loading an older one pulls again when it is done); the reserved engines, which
        share the node with the trainer, hold it at once."""
        for inst in self.fleet.pool_instances():
            if inst.state == "up" and not inst.fetching:
                self.fleet.fetch(inst)
        for inst in self.fleet.reserved():
            if not inst.paused:
                inst.version = self.clock.version

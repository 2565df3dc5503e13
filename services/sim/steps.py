"""The step-level half of the simulation: starting a step, the reserved node's seeding window,
the trainer consuming groups as they arrive, the version commit and the T_seed update.

The decisions are the services' own (services/core): the request table and its groups,
`seeding.after_step` (Algorithm 1 and N_prem) once the next version is committed, the seeding
window counted from when the reserved engines hold the step's weights. What is modelled here
is time: the trainer's micro-batches as groups arrive, one optimizer step, the publication.

With `SystemSpec.max_staleness` k > 0 up to k + 1 steps are in flight (`inflight`): steps 0..k
are queued at the start and step s + 1 + k when version s + 1 is committed. The trainer takes
the oldest step's groups only (it is sequential); later steps' groups wait for their turn. The
reserved node does not seed (window 0): it trains, and generates only when recalled.
"""

import math
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from services.contracts.messages import ReleaseReason
from services.core.collect import CollectRules
from services.core.request_table import request_id
from services.core.seeding import (
    PoolSizer,
    SeedingController,
    StepTimes,
    after_step,
    recommended_pool_size,
    train_compute_s,
)
from services.core.step_controller import StepController
from services.sim.scenario import Scenario
from services.sim.state import Instance, StepRecord, StepState, Totals
from services.sim.systems import SystemSpec
from services.sim.turns import step_table, turn_physics


class StepProtocol:
    """Mixed into `Simulation`. The state and the instance and request methods it uses are
    declared here with their types; `Simulation` sets and defines them."""

    sc: Scenario
    system: SystemSpec
    rules: CollectRules
    seed: int
    now: float
    version: int  # latest committed weights
    cur: StepState | None  # the oldest step in flight; None until `run` starts step 0
    inflight: dict[int, StepState]  # steps queued and not committed, oldest first
    max_steps: int | None
    resuming: bool  # the reserved engines are switching to rollout (a recall)
    trainer_back_s: float  # asynchronous RL: the node switches back to training until then
    # asynchronous RL: the pool's and the reserved engines' rollout busy seconds at the commit
    busy_mark: tuple[float, float]
    instances: dict[str, Instance]
    totals: Totals
    seeding: SeedingController
    pool_sizer: PoolSizer | None  # None: the pool holds every instance the trace offers
    records: list[StepRecord]

    if TYPE_CHECKING:

        def at(self, t: float, kind: str, payload: object = None) -> None: ...
        def fetch(self, inst: Instance) -> None: ...
        def reserved_generating(self) -> bool: ...
        def finished(self) -> bool: ...
        def pool_instances(self) -> list[Instance]: ...
        def pull(self, inst: Instance) -> None: ...
        def release(self, inst: Instance, count: int, cause: ReleaseReason) -> None: ...
        def want(self, wanted: int | None) -> None: ...

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
        n_pre = sum(1 for i in self.pool_instances() if i.has_heartbeat)
        window = math.inf if self.system.seeding == "colocated" else self.seeding.window_s(n_pre)
        if self.system.max_staleness:
            window = 0.0  # asynchronous: the reserved node trains (it is recalled if need be)
        st = StepState(
            step,
            StepController(table, self.rules, self.system.fair_reads),
            lengths,
            work.prompt_tokens,
            deque(table.initial_jobs()),
            self.now,
            window,
            n_pre,
        )
        st.turn_tokens, st.env_latency_s = turn_physics(step, work)
        self.inflight[step] = st
        if self.cur is None or self.cur.step not in self.inflight:
            self.cur = st
        if not self.system.max_staleness:  # (asynchronous: pulled at the commit, see swap)
            for inst in self.pool_instances():
                if inst.state == "up":
                    self.pull(inst)
        if window > 0:
            self.totals.reserved_switch_s += sc.resume_s
            self.at(self.now + sc.resume_s, "reserved_ready", step)
        else:
            st.seeded_out, st.seed_end_s = True, self.now
            self.at(self.now, "trainer_ready", step)

    def reserved(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.pool == "reserved"]

    def on_reserved_ready(self, step: int) -> None:
        st = self.step_in_flight
        for inst in self.reserved():
            inst.version, inst.paused = step, False
        st.seed_start_s = self.now
        if not math.isinf(st.window_s):
            self.at(self.now + st.window_s, "seed_end", step)

    def on_seed_end(self, step: int) -> None:
        st = self.step_in_flight
        if st.step != step or st.seeded_out:
            return
        for inst in self.reserved():
            self.release(inst, len(inst.engine.running), "seed")
        self.step_aside(st)

    def step_aside(self, st: StepState) -> None:
        """The reserved engines stop generating; the node switches to training."""
        for inst in self.reserved():
            inst.paused = True
        st.seeded_out, st.seed_end_s = True, self.now
        self.totals.reserved_switch_s += self.sc.switch_s
        self.at(self.now + self.sc.switch_s, "trainer_ready", st.step)

    def group_done(self, st: StepState, prompt: int) -> None:
        st.ready_groups.append(prompt)
        if st.table.complete:
            st.rollout_end_s = self.now
            if not st.seeded_out:
                self.step_aside(st)  # the reserved node generated to the end (co-located)
        if self.system.max_staleness and self.reserved_generating() and self.oldest_rolled_out():
            self.step_aside_async()
        self.train_next()

    def step_aside_async(self) -> None:
        """Asynchronous RL, after a recall: the oldest step's rollout is complete, so the
        reserved engines give their requests back and the node switches to training."""
        for inst in self.reserved():
            self.release(inst, len(inst.engine.running), "seed")
            inst.paused = True
        self.totals.reserved_switch_s += self.sc.switch_s
        self.trainer_back_s = self.now + self.sc.switch_s
        self.at(self.trainer_back_s, "switched")

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
        self.inflight[step].trainer_ready_s = self.now
        self.train_next()

    def train_next(self) -> None:
        """Train the next ready group of the oldest step in flight (the trainer is sequential:
        a later step's groups wait until it is the oldest). Asynchronous RL: not while the
        reserved engines generate or switch back (they share the node)."""
        if self.system.max_staleness and (
            self.resuming or self.reserved_generating() or self.now < self.trainer_back_s
        ):
            return
        st = self.step_in_flight
        if st.trainer_ready_s is None or st.training:
            return
        if not st.ready_groups:
            if st.idle_since_s is None:
                st.idle_since_s = self.now
            return
        if st.idle_since_s is not None:
            st.train_wait_s += self.now - st.idle_since_s
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
        self.at(self.now + seconds, "trained", st.step)

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
            self.at(self.now + last, "committed", step)
        elif min(self.inflight) < step:  # the version before is still being published
            st.optimize_waiting = True
        else:
            self.optimize(st)

    def optimize(self, st: StepState) -> None:
        """Asynchronous RL: the optimizer step, then the version is published while the
        trainer goes on with the next step's groups (as the services' trainer does); the next
        optimizer step waits for that commit."""
        self.totals.reserved_train_s += self.sc.trainer.optimizer_s + self.sc.trainer.publish_s
        self.at(self.now + self.sc.trainer.optimizer_s, "optimized", st.step)

    def on_optimized(self, step: int) -> None:
        later = [s for s in self.inflight if s > step]
        if later:
            self.cur = self.inflight[min(later)]
        self.at(self.now + self.sc.trainer.publish_s, "committed", step)
        self.train_next()

    def on_committed(self, step: int) -> None:
        """Version step+1 is in the weight store: adapt T_seed (Algorithm 1), start the next
        (with k > 0: step+1+k; the instances swap to the new version in the background)."""
        st = self.inflight[step]
        rollout_end_s = st.rollout_end_s
        assert rollout_end_s is not None, "the last group completed before the trainer took it"
        self.version = step + 1
        self.totals.trained += st.trained_tokens
        update = after_step(
            self.seeding,
            StepTimes(
                n_preemptible=st.n_preemptible,
                n_reserved=len(self.reserved()),
                started=st.started_s,
                seed_end=st.seed_end_s,
                rollout_end=rollout_end_s,
                committed=self.now,
                train_compute_s=st.train_s,
                train_wait_s=st.train_wait_s,
            ),
            adapt=self.system.seeding == "adaptive",
        )
        if self.system.max_staleness:
            update = replace(update, n_prem_recommended=self.n_prem_async(st))
        self.records.append(
            StepRecord(
                step=step,
                start_s=st.started_s,
                end_s=self.now,
                rollout_s=rollout_end_s - st.started_s,
                tokens=st.trained_tokens,
                prompt_tokens=st.trained_prompt_tokens,
                train_s=st.train_s,
                t_seed_s=st.window_s,
                spot_instances=st.n_preemptible,
                train_wait_s=st.train_wait_s,
                remote_wait_s=update.t_remote_wait_s,
                n_prem_recommended=update.n_prem_recommended,
            )
        )
        del self.inflight[step]
        if self.inflight:
            self.cur = self.inflight[min(self.inflight)]
        if self.pool_sizer is not None:
            self.want(self.pool_sizer.after_step(update.n_prem_recommended))
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

    def n_prem_async(self, st: StepState) -> float:
        """Asynchronous RL: steps overlap, so a step's own rollout time says little. N_prem
        (`recommended_pool_size`) is taken from the rollout work done since the last commit, about
        one step's worth: the pool's busy instance-seconds, and the reserved engines' (when
        recalled), over the step's training compute."""
        pool_busy = sum(i.engine.busy_s for i in self.instances.values() if i.pool == "preemptible")
        reserved_busy = self.totals.reserved_rollout_s
        last_pool, last_reserved = self.busy_mark
        self.busy_mark = (pool_busy, reserved_busy)
        return recommended_pool_size(
            pool_busy - last_pool,
            1,
            reserved_busy - last_reserved,
            len(self.reserved()),
            train_compute_s(st.train_s, 0.0, 0.0),
        )

    def swap(self) -> None:
        """Asynchronous RL: every up instance pulls the new version in the background (one
        still loading an older one pulls again when it is done); the reserved engines, which
        share the node with the trainer, hold it at once."""
        for inst in self.pool_instances():
            if inst.state == "up" and not inst.fetching:
                self.fetch(inst)
        for inst in self.reserved():
            if not inst.paused:
                inst.version = self.version

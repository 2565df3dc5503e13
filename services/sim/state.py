"""The state a simulation keeps: instances, the current step, and what it reports."""

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from services.contracts.messages import Job, Pool
from services.core.episodes import EpisodeTable
from services.core.request_table import RequestTable
from services.core.seeding import StepTimes
from services.core.step_controller import StepController
from services.sim.engine import SimEngine

RUN_ID = "sim"  # the one run a simulation holds: its tables' and its heartbeats'
InstanceState = Literal["booting", "pulling", "up", "noticed", "gone"]


@dataclass
class Instance:
    """One engine instance: a spot or on-demand rollout instance, or one of the reserved node's
    engines (whose node is billed once, not per engine)."""

    name: str
    pool: Pool
    engine: SimEngine
    price_per_h: float
    born_s: float
    state: InstanceState = "booting"
    version: int | None = None  # weights held
    paused: bool = False  # a reserved engine that stepped aside for the current step
    fetching: bool = False  # pulling a newer version in the background (asynchronous RL)
    gone_s: float | None = None

    @property
    def has_heartbeat(self) -> bool:
        """Registered with the coordinator (a booting instance has not yet)."""
        return self.state in ("pulling", "up")

    def slots(self) -> int:
        return min(self.engine.profile.max_seqs, self.engine.plateau.plateau())

    def alive_s(self, until: float) -> float:
        end = until if self.gone_s is None else min(self.gone_s, until)
        return max(0.0, end - self.born_s)


@dataclass
class StepState:
    """One RL step in flight: the coordinator's step controller, which decides it (its table,
    seeding window, recall, times), and what the simulation models around it."""

    step: int
    # the coordinator's own: its request table, rules, cooldown, pools, seeding window and times
    control: StepController
    lengths: dict[str, int]  # request -> length at which it stops (physics, never scheduling)
    prompt_tokens: list[int]
    queue: deque[Job]
    recalled: bool = False  # the reserved engines were called back to the step (they read it)
    times: StepTimes | None = None  # the controller's at the rollout's end (`end`)
    ready_groups: deque[int] = field(default_factory=deque)
    trainer_ready_s: float | None = None
    training: bool = False
    trained_groups: int = 0
    trained_tokens: int = 0  # response tokens of the groups trained
    trained_prompt_tokens: int = 0  # their prompts, once per response
    train_s: float = 0.0  # training compute so far (micro-batches, without waits)
    train_wait_s: float = 0.0
    idle_since_s: float | None = None
    optimize_waiting: bool = False  # all trained; the optimizer waits for the last commit
    # multi-turn (physics, as `lengths`): request -> the tokens each turn generates, and the
    # seconds the environment takes to answer each turn
    turn_tokens: dict[str, list[int]] = field(default_factory=dict)
    env_latency_s: dict[str, list[float]] = field(default_factory=dict)
    # the long tail (tail.py; empty when off): each request's acceptance, the groups with a
    # finished sibling (their drafts), each request's expected length (length-aware dispatch)
    alphas: dict[str, float] = field(default_factory=dict)
    drafted_groups: set[int] = field(default_factory=set)
    expected: dict[str, float] = field(default_factory=dict)
    spec_rng: random.Random = field(default_factory=random.Random)

    @property
    def table(self) -> RequestTable:
        return self.control.table

    @property
    def rollout_end_s(self) -> float | None:
        """When the step's last group was complete (None: it is rolling out)."""
        return None if self.times is None else self.times.rollout_end

    def stop_at(self, rid: str) -> int:
        """The response offset at which the job of `rid` that starts now stops (physics): the
        response's length, or the end of the episode's current turn."""
        turns = self.turn_tokens.get(rid)
        if turns is None:
            return self.lengths[rid]
        assert isinstance(self.table, EpisodeTable)
        episode = self.table.episodes[rid]
        return episode.starts[-1] + turns[episode.turns - 1]


@dataclass(frozen=True)
class StepRecord:
    step: int
    start_s: float
    end_s: float
    rollout_s: float
    tokens: int  # response tokens trained
    prompt_tokens: int  # prompt tokens trained (once per response)
    train_s: float  # training compute of the step (micro-batches, without waits)
    t_seed_s: float  # window used (inf: the reserved node did all of the rollout)
    spot_instances: int
    train_wait_s: float
    remote_wait_s: float
    n_prem_recommended: float


@dataclass
class Totals:
    """Token accounting over the run: generated = trained + lost + in flight (the responses
    collected in the tables of steps not yet committed)."""

    generated: int = 0  # decode tokens engines produced
    trained: int = 0  # response tokens of groups the trainer consumed
    lost_unflushed: int = 0  # generated after a killed instance's last flush
    discarded: int = 0  # collected, then thrown away by a restart (migration off)
    preemptions: int = 0
    migrations: dict[str, int] = field(default_factory=dict)
    stall_s: float = 0.0  # jobs wait and nobody can take them (see Simulation.stalled)
    recalls: int = 0  # steps the reserved pool resumed: no preemptible instance was left
    scaled_in: int = 0  # instances handed back because the pool was larger than wanted
    reserved_rollout_s: float = 0.0  # some reserved engine running requests
    reserved_train_s: float = 0.0
    reserved_switch_s: float = 0.0
    pulls: int = 0  # weight pulls started (at a boot, a step's start, a background swap)
    pull_s: float = 0.0  # their durations, as the transfer model timed them at the start
    max_pull_s: float = 0.0
    pulled_bytes: float = 0.0  # what those pulls moved (`TransferModel.pull_parts`)
    env_answers: int = 0  # multi-turn: turns the environment answered
    episodes: int = 0  # multi-turn: episodes over
    env_s: float = 0.0  # multi-turn: seconds turns waited for the environment, summed
    turns_discarded: int = 0  # multi-turn: whole turns thrown away by restarts (migration off)

    @property
    def lost(self) -> int:
        return self.lost_unflushed + self.discarded


def finite_or_none(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else x

"""One spot instance serving several runs at once, in one batch (issue 52: LoRA runs on one base
model, each request under its run's adapter); `services/rollout/lanes.py` is the worker's.

Each run's simulation sees the instance as an `Instance` of its own fleet, a lane
(`LaneInstance`): its own state (booting, pulling its adapter, up, gone), the version of its
adapter, and an engine that holds the run's requests only (`LaneEngine`: request ids are per
run, as the worker's "{run}/{id}"). The instance itself (`Worker.instance`, the pool's: its
bill, its boot, its preemption) holds the whole engine (`OneBatch`), whose batch is every
lane's requests:

- A decode step costs what one step of all of them together costs: the profile's step time at
  their sum and their mean context, the KV cache shared (a share of it runs when it is over
  capacity, as `SimEngine.rate_of`); every lane gains one level a step. Not K batches.
- A prefill in any lane stalls every lane (one engine).
- The engine is advanced once over an interval (`OneBatch.advance`: busy time, plateau), which
  fixes the batch's rate for that interval; each run's simulation then advances its lane at
  that rate (`LaneEngine.rate`) and finishes the requests that ended, and `OneBatch.thaw`
  lets the next rate be read.
- A lane reads up to its part of the instance (`LaneInstance.slots`): the worker's room (its
  slots or measured plateau, less what the other lanes hold) and the run's part of the fleet's
  allotment (`part`, set by the pool from `fleet_shares.worker_part`), as
  `rollout/intake.py` reads.

With one lane all of it is a plain `SimEngine`, to the bit. What this leaves out: the cost of
applying several adapters in one batch beyond a slower decode (the pool's profile may be given
one, `EngineProfile.decoding_at`), and an engine's limit on the adapters it holds (every run's
is held).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from services.sim.engine import SimEngine
from services.sim.profile import EngineProfile
from services.sim.state import Instance
from services.sim.tail import SpeculationModel, verify_step


class OneBatch(SimEngine):
    """A shared instance's engine as a whole: its batch is its lanes' requests (it holds none
    of its own: a request is added to its run's lane, never here). Its busy time, tokens and
    plateau are the instance's."""

    def __init__(
        self, profile: EngineProfile, verify: Callable[[float, float, float], float] | None
    ) -> None:
        super().__init__(profile, verify)
        self.lanes: list[LaneEngine] = []
        self.fixed_rate: float | None = None  # the rate of the interval being advanced
        self.several_s = 0.0  # seconds with requests of two runs or more in the batch

    def lane(self) -> "LaneEngine":
        """A new lane of this engine (the next run's)."""
        lane = LaneEngine(self)
        self.lanes.append(lane)
        return lane

    @property
    def batch(self) -> int:
        return sum(lane.batch for lane in self.lanes)

    def context_sum(self) -> float:
        return sum(lane.context_sum() for lane in self.lanes)

    def rate(self) -> float:
        """Decode steps per second of the one batch (`SimEngine.rate_of` over every lane's
        requests); while an interval is advanced, that interval's."""
        if self.fixed_rate is not None:
            return self.fixed_rate
        drafting = sum(lane.drafting for lane in self.lanes)
        return self.rate_of(self.batch, self.context_sum(), drafting)

    def advance(self, now: float, until: float) -> None:
        """The instance's account of [now, until] (busy time, tokens, plateau), and the rate
        its lanes advance at over it (until `thaw`); the lanes are advanced by their runs."""
        b = self.batch
        if b == 0:
            return
        self.busy_s += until - now
        if sum(1 for lane in self.lanes if lane.running) > 1:
            self.several_s += until - now
        start = max(now, self.stall_until)
        if until <= start:
            return
        rate = self.rate()
        self.fixed_rate = rate
        gained = rate * (until - start)
        speed = sum(lane.speed_sum for lane in self.lanes)
        self.level += gained
        self.tokens += gained * speed
        self.plateau.record(b, round(gained * speed), until - start)

    def thaw(self) -> None:
        """The interval is advanced: the next rate is read from the batch again."""
        self.fixed_rate = None

    def slots(self) -> int:
        """The requests the worker runs at once: its cap, or its measured plateau if lower
        (`Instance.slots`, over the whole batch)."""
        return min(self.profile.max_seqs, self.plateau.plateau())


class LaneEngine(SimEngine):
    """One run's requests on a shared engine (`OneBatch`): a `SimEngine` of their own levels and
    stops, advanced at the batch's rate, its prefills stalling the whole batch."""

    def __init__(self, shared: OneBatch) -> None:
        super().__init__(shared.profile, shared.verify)
        self.shared = shared

    def rate(self) -> float:
        return self.shared.rate()

    def add(
        self,
        rid: str,
        lease: int,
        context: int,
        offset: int,
        tokens: int,
        now: float,
        speed: float | None = None,
    ) -> None:
        """As `SimEngine.add`; the prefill queues behind the batch's others, and stalls it."""
        self.stall_until = self.shared.stall_until
        super().add(rid, lease, context, offset, tokens, now, speed)
        self.shared.stall_until = self.stall_until
        for lane in self.shared.lanes:
            lane.stall_until = self.stall_until


@dataclass
class LaneInstance(Instance):
    """Run r's view of a shared instance, in run r's fleet (its engine a `LaneEngine`)."""

    # the run's part of the instance's slots (`fleet_shares.worker_part`); the pool sets it
    # while several runs are placed, and leaves it at the engine's cap otherwise
    part: int = 0

    def slots(self) -> int:
        """What the run may hold here: the worker's room beside the other runs' requests,
        and its part (`rollout/intake.py`'s `free`, plus what the run holds)."""
        engine = self.engine
        assert isinstance(engine, LaneEngine)
        others = engine.shared.batch - engine.batch
        return max(0, min(engine.shared.slots() - others, self.part))


@dataclass
class Worker:
    """A spot instance that serves every run at once: the pool's instance (its bill and life,
    its engine the `OneBatch`) and one lane a run."""

    instance: Instance
    # the run whose weight store it pulls the base from, with that run's adapter, before the
    # other runs' adapters (instance i: run i mod K, as the separate deployments split the trace)
    base_run: int
    lanes: list[LaneInstance] = field(default_factory=list)

    @property
    def engine(self) -> OneBatch:
        engine = self.instance.engine
        assert isinstance(engine, OneBatch)
        return engine


def new_worker(
    index: int,
    profile: EngineProfile,
    speculation: SpeculationModel | None,
    price_per_h: float,
    now: float,
    runs: int,
) -> Worker:
    """The `index`-th spot instance, booting, with a lane for each of `runs` runs (each lane
    named as the instance: it is that instance in its run's fleet)."""
    name = f"spot-{index}"
    engine = OneBatch(profile, verify_step(profile, speculation))
    worker = Worker(Instance(name, "preemptible", engine, price_per_h, now), index % runs)
    for _ in range(runs):
        worker.lanes.append(
            # billed as the instance, once
            LaneInstance(name, "preemptible", engine.lane(), 0.0, now, part=profile.max_seqs)
        )
    return worker

"""A step as a coordinator shard drives it: `OpenStep` while it is queued and live, `StepDone`
once its rollout is over (what the seeding update needs once the trainer committed it), and the
stop tokens of the run's model."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from services.contracts.messages import Heartbeat
from services.coordinator.delta_collector import LiveStep
from services.core.seeding import StepTimes


@dataclass(frozen=True)
class StepDone:
    """A finished rollout, as the seeding controller will need it once the step is trained."""

    step: int
    times: StepTimes  # the trainer's part is filled in by `adapt`
    scratch: tuple[str, ...]  # the step's keys, deleted once the next version is committed


@dataclass
class OpenStep:
    """A step queued and live, with what its record needs."""

    live: LiveStep
    started: float  # monotonic
    window: float  # its seeding window (the leader's; 0 on a follower)
    pools: dict[str, int]
    workers: dict[str, Heartbeat]  # alive on the run when it was opened

    def times(self, rollout_end: float, seed_end: float | None = None) -> StepTimes:
        """The step's times once its rollout is over; the trainer's are known once it commits
        (`adapt`)."""
        return StepTimes(
            n_preemptible=self.pools["preemptible"],
            n_reserved=self.pools["reserved"],
            started=self.started,
            seed_end=seed_end,
            rollout_end=rollout_end,
            committed=math.nan,
            train_compute_s=math.nan,
            train_wait_s=math.nan,
        )


def stop_token_ids(model_dir: Path) -> list[int]:
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [int(eos)]

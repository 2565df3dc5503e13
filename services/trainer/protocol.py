"""What the trainer loop asks of a run's policy, as typing protocols.

`TrainablePolicy` is every call a run's trainer makes (run_trainer.py, and versions.py for the
weights); `policy.Policy` (one process), `ranks.Leader` (rank 0 of N, handing each call on) and
benchmarks' stand-ins without a model implement it. `ScheduledPolicy` adds the learning-rate
schedule, which a trainer that resumed from the weight store puts back in place; a stand-in
without one is told apart by `isinstance` (runtime-checkable). No implementation here.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from services.contracts.messages import Group
from services.state.step_metrics import StepRow


class TrainablePolicy(Protocol):
    """A run's model and optimizer, driven one RL step at a time. Synchronous (the trainer runs
    each call in a thread, one call at a time)."""

    def accumulate(self, groups: list[Group]) -> None:
        """Take these groups into the step (backpropagating them now or at its end)."""
        ...

    def optimizer_step(self) -> StepRow:
        """Apply the step's gradient; what the step trained (its metrics row's fields)."""
        ...

    def snapshot(self, folder: Path) -> Callable[[], None]:
        """Copy the training state now; the function returned writes it into `folder`."""
        ...

    def restore(self, folder: Path) -> None:
        """Take the training state of a checkpoint `snapshot` wrote."""
        ...

    def load_weights(self, folder: Path) -> None:
        """Take the weights of a committed version."""
        ...

    def export_files(self, version: int) -> dict[str, bytes]:
        """The current weights as the files of version `version` (file name -> content)."""
        ...


@runtime_checkable
class ScheduledPolicy(TrainablePolicy, Protocol):
    """A policy with a learning-rate schedule that can be put at any step."""

    def schedule_at(self, version: int) -> None:
        """Put the schedule where it is after `version` RL steps."""
        ...

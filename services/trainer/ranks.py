"""The trainer as N ranks under torchrun: rank 0 is the service (Redis, HTTP, the weight store,
checkpoints' manifest) and the other ranks follow it.

Rank 0's policy is a `Leader`: each call it takes (a step's groups, an optimizer step, an
export, a checkpoint) is first broadcast to the other ranks, on a gloo group of its own, and
then made; each follower makes the same call on its own `ShardedPolicy` (sharded.py), so every
collective inside it meets its peers. Calls go one at a time (a lock), in the order rank 0 makes
them. A follower whose leader is gone (rank 0 died: the broadcast fails) exits, and torchrun
ends the rest.

`SPOTRL_TRAINER_RANKS=N` makes `python -m services.trainer.main` start itself under
`torch.distributed.run --standalone --nproc-per-node N`; on several nodes, run torchrun
yourself (README, "Training on N GPUs").
"""

import datetime
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from services.contracts.messages import Group
from services.contracts.runspec import RunSpec
from services.infra.lifeline import die_with_parent
from services.state.step_metrics import StepRow

if TYPE_CHECKING:
    from services.trainer.sharded import ShardedPolicy

log = logging.getLogger(__name__)
IDLE_TIMEOUT = datetime.timedelta(days=7)  # a follower waits this long for rank 0's next call
_control: Any = None  # the process group of the calls


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_device(device: str) -> str:
    """This rank's device: its own GPU (LOCAL_RANK) when the setting names CUDA."""
    if device.startswith("cuda") and world_size() > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def init(device: str) -> None:
    """Join the ranks (torchrun's environment): gloo on CPU, NCCL for CUDA tensors and gloo for
    CPU ones on GPUs."""
    global _control
    # die with torchrun's agent: it starts each rank in a session of its own, so a SIGKILL to
    # the agent's process group would leave the ranks running, rank 0 holding the service's port
    die_with_parent()
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(rank_device(device)))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    _control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def _send(name: str, args: tuple) -> None:
    dist.broadcast_object_list([(name, args)], src=0, group=_control)


def _receive() -> tuple[str, tuple]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


class Leader:
    """Rank 0's policy: a `ShardedPolicy` whose every call the other ranks make too (a
    `protocol.ScheduledPolicy`)."""

    def __init__(self, policy: "ShardedPolicy") -> None:
        self._policy = policy
        self._lock = threading.Lock()

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            _send(name, args)
            return getattr(self._policy, name)(*args)

    def accumulate(self, groups: list[Group]) -> None:
        self._call("accumulate", groups)

    def optimizer_step(self) -> StepRow:
        return self._call("optimizer_step")

    def snapshot(self, folder: Path) -> Callable[[], None]:
        return self._call("snapshot", folder)

    def restore(self, folder: Path) -> None:
        self._call("restore", folder)

    def load_weights(self, folder: Path) -> None:
        self._call("load_weights", folder)

    def export_files(self, version: int) -> dict[str, bytes]:
        return self._call("export_files", version)

    def schedule_at(self, version: int) -> None:
        self._call("schedule_at", version)


def lead(model_dir: Path, spec: RunSpec, device: str) -> Leader:
    """A run's policy on rank 0 (the trainer loop's policy factory under torchrun)."""
    from services.trainer.sharded import ShardedPolicy

    _send("open", (model_dir, spec, device))
    return Leader(ShardedPolicy(model_dir, spec, rank_device(device)))


def release() -> None:
    """Rank 0 is leaving: the followers exit, and the process groups go while the interpreter
    is whole (a gloo group left to the interpreter's exit aborts the process: SIGABRT,
    "terminate called without an active exception", seen in CI)."""
    global _control
    if _control is None:
        return
    _send("exit", ())
    _control = None
    dist.destroy_process_group()


def follow() -> None:
    """A follower's life: make rank 0's calls until it leaves."""
    # a SIGTERM (torchrun hands it on) is rank 0's to act on: it checkpoints at exit, with the
    # followers, then releases them; a follower whose rank 0 died exits on the broken broadcast
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _follow()
    finally:
        dist.destroy_process_group()


def _follow() -> None:
    from services.trainer.sharded import ShardedPolicy

    policy: ShardedPolicy | None = None
    while True:
        name, args = _receive()
        if name == "exit":
            break
        if name == "open":
            model_dir, spec, device = args
            policy = None  # the last run's, freed before the next is built
            policy = ShardedPolicy(model_dir, spec, rank_device(device))
        elif policy is None:
            raise RuntimeError(f"rank {rank()}: {name} before any run")
        else:
            getattr(policy, name)(*args)
    if policy is not None:
        policy.finish_writes()
    log.info("rank %d: rank 0 left", rank())

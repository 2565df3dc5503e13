"""Trainer checkpoints on local disk: the policy's full state (fp32 weights, optimizer moments,
RNG) after the optimizer step that made weight version `step`, plus the data position.

A checkpoint is written to a scratch folder, renamed into place, and only then named in the
`LATEST` file (itself replaced atomically): a trainer killed while writing one resumes from the
previous one. The newest `keep` are kept. What the folder holds is the policy's business
(`snapshot` writes it, `restore` reads it: one `state.pt`, or a sharded trainer's
torch.distributed.checkpoint files); `meta.json` is written last.

`BackgroundWriter` writes them off the training path: the step blocks only while the policy
copies its state (`snapshot`, on the trainer's compute thread: torch work on any other thread
slows the compute thread's for the rest of the process, see services/infra/compute.py), and
the write, the fsync and the rename happen in a thread of their own, at most one at a time.
Which steps are checkpointed is `due`'s call (every K steps or T seconds).
"""

import concurrent.futures
import io
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


STATE_FILE = "state.pt"  # a single process's state, torch.save'd
META_FILE = "meta.json"


@dataclass(frozen=True)
class Checkpoint:
    step: int  # the weight version this state is (training resumes at this step)
    folder: Path

    @property
    def meta(self) -> dict:
        return json.loads((self.folder / META_FILE).read_text())


class Checkpoints:
    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def latest(self) -> Checkpoint | None:
        try:
            name = (self.root / "LATEST").read_text().strip()
        except FileNotFoundError:
            return None
        folder = self.root / name
        if not (folder / META_FILE).is_file():
            return None
        return Checkpoint(int(name.removeprefix("step-")), folder)

    def scratch(self, step: int) -> Path:
        """The empty folder the checkpoint of `step` is written to before `commit`."""
        self.root.mkdir(parents=True, exist_ok=True)
        folder = self._partial(step)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        return folder

    def commit(self, step: int, meta: dict) -> Checkpoint:
        """Make what was written to `scratch(step)` the checkpoint of `step`: its files on disk,
        then renamed into place and named in LATEST."""
        name = _name(step)
        scratch = self._partial(step)
        (scratch / META_FILE).write_text(json.dumps({"step": step, **meta}))
        for path in sorted(scratch.rglob("*")):
            if path.is_file():
                with open(path, "rb") as fh:
                    os.fsync(fh.fileno())
        final = self.root / name
        shutil.rmtree(final, ignore_errors=True)
        os.rename(scratch, final)
        pointer = self.root / ".LATEST.partial"
        pointer.write_text(name)
        os.replace(pointer, self.root / "LATEST")
        for old in sorted(self.root.glob("step-*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return Checkpoint(step, final)

    def discard_after(self, step: int) -> Checkpoint | None:
        """Remove the checkpoints of steps after `step` (their state is ahead of what the run
        holds); LATEST names the newest one left. That one, or None."""
        kept = []
        for folder in sorted(self.root.glob("step-*")):
            if int(folder.name.removeprefix("step-")) > step:
                shutil.rmtree(folder, ignore_errors=True)
            elif (folder / META_FILE).is_file():
                kept.append(folder.name)
        if kept:
            pointer = self.root / ".LATEST.partial"
            pointer.write_text(kept[-1])
            os.replace(pointer, self.root / "LATEST")
        else:
            (self.root / "LATEST").unlink(missing_ok=True)
        return self.latest()

    def _partial(self, step: int) -> Path:
        return self.root / f".{_name(step)}.partial"

    def save(
        self, step: int, snapshot: Callable[[Path], Callable[[], None]], meta: dict
    ) -> Checkpoint:
        """Write the checkpoint of `step` now: `snapshot(folder)` (a policy's) copies the state
        and returns the function that writes it to `folder`."""
        snapshot(self.scratch(step))()
        return self.commit(step, meta)


def _name(step: int) -> str:
    return f"step-{step:08d}"


def due(step: int, last_step: int, last_s: float, now_s: float, every: int, every_s: float) -> bool:
    """Whether the state after `step` (a weight version) is checkpointed: `every` steps after
    the last checkpoint, or `every_s` seconds after it."""
    return step - last_step >= every or (step > last_step and now_s - last_s >= every_s)


def serialize(state: dict) -> bytes:
    """A state as the bytes of its `state.pt`: a copy that the next steps' training does not
    change."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def snapshot_of(state: dict, folder: Path) -> Callable[[], None]:
    """A single process's state, copied now (`serialize`); the function returned writes it to
    `folder` as its `state.pt`."""
    data = serialize(state)

    def write() -> None:
        (Path(folder) / STATE_FILE).write_bytes(data)

    return write


def read_state(folder: Path) -> dict:
    """The state a `snapshot_of` wrote."""
    return torch.load(Path(folder) / STATE_FILE, map_location="cpu", weights_only=False)


class BackgroundWriter:
    """Writes checkpoints in a thread, one at a time; `submit` refuses while one is in flight
    (the step is checkpointed later, once due again)."""

    def __init__(self, ckpts: Checkpoints) -> None:
        self.ckpts = ckpts
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pending: concurrent.futures.Future | None = None
        self.written = -1  # the step of the newest checkpoint this writer finished

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def submit(self, step: int, write: Callable[[], None], meta: dict) -> bool:
        """Finish the checkpoint of `step` in the thread: `write()` (what a policy's `snapshot`
        returned for `ckpts.scratch(step)`), then the commit."""
        if self.busy:
            return False
        self._collect()
        self._pending = self._pool.submit(self._write, step, write, meta)
        return True

    def _write(self, step: int, write: Callable[[], None], meta: dict) -> Checkpoint:
        write()
        return self.ckpts.commit(step, meta)

    def _collect(self) -> None:
        """The outcome of the last write: a failed one is logged, and training goes on (the
        weights are safe in the weight store; a resumed trainer takes them from there)."""
        if self._pending is None or not self._pending.done():
            return
        try:
            self.written = self._pending.result().step
        except Exception:
            log.exception("a background checkpoint failed")
        self._pending = None

    def wait(self) -> None:
        """Block until the write in flight is done (at exit, before a final checkpoint)."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
            self._collect()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)


def training_state(model: torch.nn.Module, optimizer: Any, scheduler: Any) -> dict:
    """A single process's training state: weights, optimizer moments, the LR schedule's
    position and the RNG (of the CPU, and of the GPUs where there are)."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng,
    }


def load_training_state(
    state: dict, model: torch.nn.Module | None, optimizer: Any, scheduler: Any
) -> None:
    """Put back a state `training_state` took (its weights into `model`, unless None: the
    caller put them back)."""
    if model is not None:
        model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if "scheduler" in state:  # a checkpoint from before schedules: the schedule's start
        scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])

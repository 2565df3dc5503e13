"""Trainer checkpoints on local disk: the policy's full state (fp32 weights, optimizer moments,
RNG) after the optimizer step that made weight version `step`, plus the data position.

A checkpoint is written to a scratch folder, renamed into place, and only then named in the
`LATEST` file (itself replaced atomically): a trainer killed while writing one resumes from the
previous one. The newest `keep` are kept.

`BackgroundWriter` writes them off the training path: the step blocks only while the state is
serialized to memory (`serialize`, on the trainer's compute thread: torch work on any other
thread slows the compute thread's for the rest of the process, see services/common/compute.py),
and the write, the fsync and the rename happen in a thread of their own, at most one at a time.
Which steps are checkpointed is `due`'s call (every K steps or T seconds).
"""

import concurrent.futures
import io
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    step: int  # the weight version this state is (training resumes at this step)
    folder: Path

    def load(self) -> dict:
        return torch.load(self.folder / "state.pt", map_location="cpu", weights_only=False)

    @property
    def meta(self) -> dict:
        return json.loads((self.folder / "meta.json").read_text())


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
        if not (folder / "state.pt").is_file():
            return None
        return Checkpoint(int(name.removeprefix("step-")), folder)

    def save(self, step: int, state: dict | bytes, meta: dict) -> Checkpoint:
        """Write a state (or its `serialize`d bytes) as the checkpoint of `step`."""
        data = state if isinstance(state, bytes) else serialize(state)
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"step-{step:08d}"
        scratch = self.root / f".{name}.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        (scratch / "state.pt").write_bytes(data)
        (scratch / "meta.json").write_text(json.dumps({"step": step, **meta}))
        for path in (scratch / "state.pt", scratch / "meta.json"):
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

    def submit(self, step: int, state: bytes, meta: dict) -> bool:
        if self.busy:
            return False
        self._collect()
        self._pending = self._pool.submit(self.ckpts.save, step, state, meta)
        return True

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

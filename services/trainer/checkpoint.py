"""Trainer checkpoints on local disk: the policy's full state (fp32 weights, optimizer moments,
RNG) after the optimizer step that made weight version `step`, plus the data position.

A checkpoint is written to a scratch folder, renamed into place, and only then named in the
`LATEST` file (itself replaced atomically): a trainer killed while writing one resumes from the
previous one. The newest `keep` are kept.
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch


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

    def save(self, step: int, state: dict, meta: dict) -> Checkpoint:
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"step-{step:08d}"
        scratch = self.root / f".{name}.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        torch.save(state, scratch / "state.pt")
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

"""The rollout dump: every trained group of a step as one JSON line, in `DIR/step-NNNNNN.jsonl`
(like verl's `rollout_data_dir`), for people who want to read what the policy generated. A step
trained again after a restart rewrites its file whole (written aside, then renamed), so a file
holds each group of its step once. Quarantined groups are there too, with no responses.

Off unless the trainer's `rollouts_dir` is set: it grows with the run, unlike Redis.
"""

import os
from pathlib import Path

from services.contracts.messages import Group


def step_file(folder: Path, step: int) -> Path:
    return folder / f"step-{step:06d}.jsonl"


def write_rollouts(folder: Path, step: int, groups: list[Group]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = step_file(folder, step)
    tmp = path.with_suffix(".jsonl.part")
    with tmp.open("w", encoding="utf-8") as out:
        for group in sorted(groups, key=lambda g: g.prompt_index):
            out.write(group.to_json() + "\n")
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)
    return path


def read_rollouts(folder: Path) -> list[Group]:
    """The groups of every step dumped in `folder` (a run's), by step then prompt."""
    groups = []
    for path in sorted(folder.glob("step-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            groups.append(Group.from_json(line))
    return groups

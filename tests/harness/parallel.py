"""`make test` runs the tests in two worker processes (pytest-xdist, `-n 2 --dist loadgroup`):
this module says which tests must share a worker, and carries the skip report's groups from the
workers, which collect the tests, to the controller, which prints the report.

- Every test module is one group, so that a module's fixtures (a deployment started once per
  module) are set up once, on one worker.
- The tests that drive a Docker engine (Compose, Swarm, the scaler's Swarm target) are one group:
  they never run beside each other.
"""

import json
import os
from pathlib import Path

DOCKER_FOLDERS = {"compose", "swarm"}
DOCKER_MODULES = {"test_scale.py"}  # `spotrl scale --target swarm` against a real Swarm
GROUPS_FILE = "skip-groups-{worker}.json"


def group_of(path: Path, tests_root: Path) -> str:
    """The xdist group of the tests in file `path` (under `tests_root`)."""
    rel = path.relative_to(tests_root)
    if DOCKER_FOLDERS & set(rel.parts) or rel.name in DOCKER_MODULES:
        return "docker"
    return rel.as_posix()


def write_groups(folder: str, worker: str, groups: dict[str, str | None]) -> None:
    """A worker's skip groups by node id, for the controller to read: written whole or not at
    all (a rename), since the controller reads every worker's file when the first of them has
    collected, maybe while another writes its own (a file over 128 KiB is written in parts)."""
    path = Path(folder, GROUPS_FILE.format(worker=worker))
    part = path.with_name(f".{path.name}.part")
    part.write_text(json.dumps(groups))
    os.replace(part, path)


def read_groups(folder: str) -> dict[str, str | None]:
    """Every worker's skip groups so far, by node id."""
    groups: dict[str, str | None] = {}
    for path in sorted(Path(folder).glob(GROUPS_FILE.format(worker="*"))):
        groups.update(json.loads(path.read_text()))
    return groups

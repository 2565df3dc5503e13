"""Environments for tests/integration/test_multi_turn.py, imported by the coordinator's
environment processes (allowed by SPOTRL_ENVIRONMENT_MODULES, importable through PYTHONPATH).

`Misbehaving` is retry_arithmetic whose process dies (os._exit) on its first call of a run and
hangs on its second, once each: marker files in MULTI_TURN_TEST_DIR say what it already did, so
a process started again behaves. `ReturnsDict` fails every call (a run that would train
nothing); `SometimesRaises` fails some (a degraded run)."""

import os
import time
from pathlib import Path

from services.environments.builtin import RetryArithmetic


class Misbehaving(RetryArithmetic):
    def step(self, row, turns, feedback):
        folder = Path(os.environ["MULTI_TURN_TEST_DIR"])
        for what in ("crash", "hang"):
            marker = folder / what
            try:
                marker.touch(exist_ok=False)
            except FileExistsError:
                continue
            if what == "crash":
                os._exit(3)
            time.sleep(3600)  # killed at the spec's environment_timeout_s
        return super().step(row, turns, feedback)


class ReturnsDict(RetryArithmetic):
    """A mistake a user makes: `step()` returns a dict, not a Feedback (every call fails)."""

    def step(self, row, turns, feedback):
        return {"observation": "", "reward": 1.0, "done": True}


class SometimesRaises(RetryArithmetic):
    """Raises on every fifth call of its process (a share of each step's calls well under a
    half), and allows 4 turns of its own (the spec sets none)."""

    def __init__(self):
        super().__init__(max_turns=4)
        self.calls = 0

    def step(self, row, turns, feedback):
        self.calls += 1
        if self.calls % 5 == 0:
            raise ValueError(f"call {self.calls} failed on purpose")
        return super().step(row, turns, feedback)

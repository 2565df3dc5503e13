"""Environments for tests/integration/test_multi_turn.py, imported by the coordinator's
environment processes (allowed by SPOTRL_ENVIRONMENT_MODULES, importable through PYTHONPATH).

`Misbehaving` is retry_arithmetic whose process dies (os._exit) on its first call of a run and
hangs on its second, once each: marker files in MULTI_TURN_TEST_DIR say what it already did, so
a process started again behaves."""

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

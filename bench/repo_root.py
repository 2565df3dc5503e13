"""Puts the repository root on `sys.path`, so that a benchmark run as a script
(`.venv/bin/python bench/X.py`, which puts bench/ first on the path) imports the test harness
(`tests.harness`) as the tests do. Import it before any `tests.` module."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.append(ROOT)

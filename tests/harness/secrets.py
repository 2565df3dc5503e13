"""`spotrl secrets` as the Compose and Swarm tests run it: in a subprocess, without the caller's
SPOTRL_API_TOKEN (each call makes its own admin token), and its env files read back."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_secrets(out: Path, *args: str) -> Path:
    env = {k: v for k, v in os.environ.items() if k != "SPOTRL_API_TOKEN"}
    cmd = [sys.executable, "-m", "services.cli.main", "secrets", str(out), *args]
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True, timeout=60)
    return out


def read_env(path: Path) -> dict[str, str]:
    """An env file `spotrl secrets` wrote: NAME=value a line."""
    return dict(line.split("=", 1) for line in path.read_text().splitlines())

"""The soak benchmark, short: two minutes at full speed with a load worker killed every 40 s.
Redis memory must not grow with time (bounded by the step, not the run: peaks over 30 s right
after the warm-up and at the end), the streams stay short, the killed workers' jobs are
reclaimed, and the audit finds every trained response once."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_STREAM_LEN = 5000


def test_soak_memory_stays_flat(tmp_path):
    cmd = [
        sys.executable,
        "bench/soak.py",
        "--minutes",
        "2",
        "--warmup-s",
        "30",
        "--kill-every-s",
        "40",
        "--json-out",
        str(tmp_path / "soak.json"),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-4000:]
    result = json.loads(lines[-1])
    print(lines[-1])  # the figures, with pytest -s
    detail = f"{result}\n{done.stderr[-3000:]}"
    assert result["tokens"] > 0, detail
    assert result["steps"] > 0, detail
    assert result["kills"] >= 2, detail
    assert result["reclaimed"] >= 1, detail  # a victim's jobs went to another worker
    assert result["declared_dead_alive"] == 0, detail  # no live worker taken for dead
    assert result["coordinator_errors"] == 0, detail
    assert result["lost"] == 0, detail
    assert result["duplicated"] == 0, detail
    assert result["mem_growth"] <= 1.2, detail
    assert result["deltas_len_last"] < MAX_STREAM_LEN, detail
    assert result["groups_len_last"] < MAX_STREAM_LEN, detail

"""bench/gpu_checks.sh, the script a lent GPU machine runs (issue 54), runs on the CPU with
`--cpu`: every part, small, with the figures the GPU run reports. It catches a part broken here
before a GPU's minutes are spent on it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = {  # part -> figures its result holds
    "long_tail": ("tokens_per_forward", "rollout_speedup", "acceptance", "device"),
    "long_tail_0.6b": ("oracle_tokens_per_forward", "oracle_speedup", "oracle_acceptance"),
    "trainer": ("padded_mfu", "lora_mfu", "lora_vs_full", "device"),
    "adapter_load": ("full_load_s", "adapter_load_s", "full_vs_adapter", "adapter_bytes"),
    "up": ("steps", "lost", "duplicated", "tokens_per_s_mean"),
    "up_lora": ("steps", "lost", "duplicated", "tokens_per_s_mean"),
}


@pytest.mark.slow
def test_every_part_of_the_gpu_script_runs_on_the_cpu(tmp_path):
    env = {**os.environ, "PY": sys.executable, "SPOTRL_HOME": str(tmp_path / "home")}
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        ["bash", "bench/gpu_checks.sh", "--cpu", str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    log = (tmp_path / "out" / "log.txt").read_text() if (tmp_path / "out").exists() else ""
    results = (tmp_path / "out" / "results.jsonl").read_text()
    rows = [json.loads(line) for line in results.splitlines()]
    assert out.returncode == 0, (rows, out.stdout[-2000:], log[-4000:])
    got = {row["part"]: row for row in rows}
    assert sorted(got) == sorted(PARTS), got
    for part, figures in PARTS.items():
        result = got[part]["result"]
        assert got[part]["rc"] == 0 and result, (part, got[part], log[-4000:])
        missing = [f for f in figures if f not in result]
        assert not missing, (part, missing, result)
    for part in ("up", "up_lora"):
        result = got[part]["result"]
        assert result["state"] == "succeeded", result
        assert (result["steps"], result["lost"], result["duplicated"]) == (2, 0, 0), result
    assert (got["up"]["result"]["lora_r"], got["up_lora"]["result"]["lora_r"]) == (None, 8)
    # the replay drafts at the task model's acceptance, as the GPU run does
    assert (
        got["long_tail_0.6b"]["result"]["oracle_draft_token_right"]
        == (got["long_tail"]["result"]["acceptance"])
    )

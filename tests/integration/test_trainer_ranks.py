"""The trainer as 2 ranks (torchrun, FSDP2 on gloo, CPU): a step gives the weights that one
process gives, within 1e-5 (fp32), and so does the next step of a policy restored from the
ranks' torch.distributed.checkpoint; a 2-rank trainer SIGKILLed mid-step (its torchrun agent
and both ranks) comes back from its checkpoint and the run ends exact."""

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file

from services.cli.procs import thread_env
from tests.harness.deploy import DeploymentConfig

from .conftest import deploy_config, small_spec
from .test_crash import check_run, wait_mid_step, wait_past

pytestmark = pytest.mark.timeout(600)
SPECS = {
    # padded micro-batches of 3 (ranks train 2 and 1 rows), a reference model, two iterations
    "padded-grpo-kl": {"micro_batch_size": 3, "beta": 0.04, "num_iterations": 2},
    # packed by tokens, bnpo (a micro-batch's token mean: the ranks divide by the whole's)
    "packed-bnpo": {"max_tokens_per_micro_batch": 30, "loss_type": "bnpo"},
    # dapo under batch scaling: both factors applied at the optimizer step
    "packed-dapo-batch": {
        "max_tokens_per_micro_batch": 40,
        "loss_type": "dapo",
        "scale_rewards": "batch",
    },
}


def train(model, out, spec: dict, ranks: int) -> None:
    out.mkdir()
    full = {"steps": 2, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6} | spec
    args = [sys.executable, "-m", "tests.ranks.step", str(model), str(out), json.dumps(full)]
    if ranks > 1:
        args[1:3] = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            "-m",
            "tests.ranks.step",
        ]
    done = subprocess.run(
        args, env=os.environ | thread_env(1), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_two_ranks_train_what_one_process_trains(tmp_path, tiny_model, name):
    train(tiny_model, tmp_path / "one", SPECS[name], ranks=1)
    train(tiny_model, tmp_path / "two", SPECS[name], ranks=2)
    for step in ("step1", "step2"):  # step2: after a restore from the checkpoint
        one = load_file(tmp_path / "one" / step / "model.safetensors")
        two = load_file(tmp_path / "two" / step / "model.safetensors")
        base = load_file(tiny_model / "model.safetensors")
        assert one.keys() == two.keys() == base.keys()
        for key in one:
            assert torch.allclose(one[key], two[key], rtol=0, atol=1e-5), (step, key)
        assert any(not torch.equal(one[k], base[k]) for k in one)  # it did train
    for row in ("row1.json", "row2.json"):
        a = json.loads((tmp_path / "one" / row).read_text())
        b = json.loads((tmp_path / "two" / row).read_text())
        assert a["trained_sequences"] == b["trained_sequences"] == 16
        assert a["trained_tokens"] == b["trained_tokens"]
        for field in ("policy_loss", "kl", "clip_fraction", "grad_norm"):
            assert b[field] == pytest.approx(a[field], rel=1e-5, abs=1e-7), (row, field)
    # the ranks' checkpoint: torch.distributed.checkpoint files of both ranks
    names = {p.name for p in (tmp_path / "two" / "ckpt").iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"} <= names


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return deploy_config(
        tmp_path_factory.mktemp("ranks"),
        flush_tokens=1,
        trainer_ranks=2,
        extra_env={"SPOTRL_STEP_DELAY_MS": "120", "SPOTRL_CHECKPOINT_EVERY": "1"},
    )


def test_a_two_rank_trainer_killed_mid_step_resumes_from_its_checkpoint(
    deployment, client, rdb, tiny_model
):
    body = small_spec(tiny_model, steps=6, prompts_per_step=8, max_new_tokens=8)
    run_id = client.submit(body)
    wait_past(rdb, run_id, 1)  # checkpoints of versions 1 and 2 (every step) are written
    step = wait_mid_step(rdb, run_id)
    # SIGKILL to torchrun's agent and its ranks; the next trainer checkpoints only at exit
    deployment.restart("trainer", kill=True, settings={"SPOTRL_CHECKPOINT_EVERY": "1000"})
    wait_past(rdb, run_id, step)
    step = wait_mid_step(rdb, run_id)
    # SIGTERM: rank 0 writes the ranks' checkpoint at exit, the next one resumes from it
    deployment.restart("trainer", kill=False)
    wait_past(rdb, run_id, step)
    check_run(deployment, client, rdb, run_id, body)
    log = (deployment.log_dir / "trainer.log").read_text()
    assert log.count("from its checkpoint") >= 2, log[-3000:]
    status = httpx.get(f"{deployment.trainer_url}/v1/status", timeout=5).json()
    assert status["ranks"] == 2, status
    assert "at exit" in log
    # the checkpoints are the two ranks' shards (torch.distributed.checkpoint)
    ckpts = deployment.work_dir / "trainer" / run_id / "checkpoints"
    newest = ckpts / (ckpts / "LATEST").read_text().strip()
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in newest.iterdir()}

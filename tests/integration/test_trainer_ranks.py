"""The trainer as 2 ranks (torchrun, FSDP2 on gloo, CPU): a step gives the weights that one
process gives, within 1e-5 (fp32), and so does the next step of a policy restored from the
ranks' torch.distributed.checkpoint; so does a LoRA run's adapter, its versions the files one
process writes (version 0 the base, later ones the adapter); a 2-rank trainer SIGKILLed
mid-step (its torchrun agent and both ranks) comes back from its checkpoint and the run ends
exact."""

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from services.cli.procs import thread_env
from services.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
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
# LoRA, padded micro-batches of 3 and a KL term (its reference: the adapter disabled)
LORA_SPEC = {
    "lora_r": 4,
    "lora_alpha": 8,
    "learning_rate": 1e-2,
    "micro_batch_size": 3,
    "beta": 0.04,
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
    # a version loaded back into the ranks: its weights, exactly
    for loaded, version in (("loaded1", "step1"), ("loaded0", "step0")):
        a = load_file(tmp_path / "two" / loaded / "model.safetensors")
        b = load_file(tmp_path / "two" / version / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in b), loaded
    check_rows(tmp_path)
    check_checkpoint(tmp_path / "two" / "ckpt")


def check_rows(tmp_path) -> None:
    """The two runs' metrics rows: the same sizes, the same measures (within 1e-5)."""
    for row in ("row1.json", "row2.json"):
        a = json.loads((tmp_path / "one" / row).read_text())
        b = json.loads((tmp_path / "two" / row).read_text())
        assert a["trained_sequences"] == b["trained_sequences"] == 16
        assert a["trained_tokens"] == b["trained_tokens"]
        for field in ("policy_loss", "kl", "clip_fraction", "grad_norm"):
            assert b[field] == pytest.approx(a[field], rel=1e-5, abs=1e-7), (row, field)


def check_checkpoint(folder) -> list[str]:
    """The ranks' checkpoint: torch.distributed.checkpoint files of both ranks; the names of
    the weights it holds."""
    names = {p.name for p in folder.iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"} <= names
    held = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return [k.removeprefix("model.") for k in held if k.startswith("model.")]


def adapter_files(folder) -> tuple[dict, dict[str, torch.Tensor]]:
    """An adapter version's folder: its config and its tensors (nothing else in it)."""
    assert {p.name for p in folder.iterdir()} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}, folder
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    return config, load_file(folder / ADAPTER_WEIGHTS)


def test_two_ranks_train_the_lora_adapter_one_process_trains(tmp_path, tiny_model):
    train(tiny_model, tmp_path / "one", LORA_SPEC, ranks=1)
    train(tiny_model, tmp_path / "two", LORA_SPEC, ranks=2)
    one, two = tmp_path / "one", tmp_path / "two"
    # version 0: the base's own folder, whole and exact (the ranks' shards gathered)
    v0 = {p.name: p.read_bytes() for p in (one / "step0").iterdir()}
    assert v0 == {p.name: p.read_bytes() for p in (two / "step0").iterdir()}
    base = load_file(tiny_model / "model.safetensors")
    v0_weights = load_file(two / "step0" / "model.safetensors")
    assert v0_weights.keys() == base.keys()
    assert all(torch.equal(v0_weights[k], base[k]) for k in base)
    # later versions: the adapter alone, its PEFT files as one process writes them
    adapters = {}
    for version in ("step1", "step2", "loaded1", "loaded0"):
        config_one, a = adapter_files(one / version)
        config_two, b = adapter_files(two / version)
        assert config_one == config_two and config_one["r"] == 4, version
        assert a.keys() == b.keys() and a, version
        for key in a:
            assert torch.allclose(a[key], b[key], rtol=0, atol=1e-5), (version, key)
        adapters[version] = b
    trained = [k for k in adapters["step1"] if ".lora_B." in k]
    assert trained and any(adapters["step1"][k].abs().sum() > 0 for k in trained)
    # an adapter version loaded back (over step 2's): exactly; then the base's folder: the
    # adapter at its start (B zero, A as loaded)
    assert any(not torch.equal(adapters["step2"][k], v) for k, v in adapters["step1"].items())
    assert all(torch.equal(adapters["loaded1"][k], v) for k, v in adapters["step1"].items())
    for key, value in adapters["loaded0"].items():
        expected = torch.zeros_like(value) if ".lora_B." in key else adapters["step1"][key]
        assert torch.equal(value, expected), key
    check_rows(tmp_path)
    # the checkpoint (step2 above resumed from it) holds the adapter's shards, not the base
    held = check_checkpoint(two / "ckpt")
    assert held and all(".lora_" in k for k in held), held[:3]


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

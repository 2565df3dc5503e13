"""Trainer checkpoints: named in LATEST only once whole; a cut-off write leaves the previous one;
the newest `keep` stay; a policy's state round-trips exactly."""

import torch

from services.trainer.checkpoint import Checkpoints


def test_latest_names_only_whole_checkpoints(tmp_path):
    ckpts = Checkpoints(tmp_path, keep=2)
    assert ckpts.latest() is None
    for step in (1, 2, 3):
        ckpts.save(step, {"w": torch.full((2,), float(step))}, {"run_id": "r"})
    latest = ckpts.latest()
    assert latest.step == 3 and latest.meta["run_id"] == "r"
    assert torch.equal(latest.load()["w"], torch.full((2,), 3.0))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]
    # a write cut off before its rename is a scratch folder nobody reads
    (tmp_path / ".step-00000004.partial").mkdir()
    (tmp_path / ".step-00000004.partial" / "state.pt").write_bytes(b"half")
    assert ckpts.latest().step == 3


def test_policy_state_round_trips(tmp_path, tiny_model):
    from services.common.runspec import RunSpec
    from services.trainer.policy import Policy

    spec = RunSpec(model=str(tiny_model), steps=2)
    a = Policy(tiny_model, spec)
    for p in a.model.parameters():
        p.grad = torch.ones_like(p)
    a.optimizer_step()
    torch.rand(3)
    state = a.state()
    expected_next = torch.rand(2)
    b = Policy(tiny_model, spec)
    b.load_state(state)
    assert torch.equal(torch.rand(2), expected_next)  # the RNG goes on where it was
    pairs = zip(a.model.named_parameters(), b.model.named_parameters(), strict=True)
    for (na, pa), (nb, pb) in pairs:
        assert na == nb and torch.equal(pa, pb)
    assert b.optimizer.state_dict()["state"][0]["step"] == 1

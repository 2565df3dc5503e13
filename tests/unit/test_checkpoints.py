"""Trainer checkpoints: named in LATEST only once whole; a cut-off write leaves the previous one;
the newest `keep` stay; a policy's state round-trips exactly."""

import torch

from services.trainer.checkpoint import Checkpoints, read_state, snapshot_of


def snapshot(state: dict):
    """What a policy's `snapshot` is, for a plain state."""
    return lambda folder: snapshot_of(state, folder)


def test_latest_names_only_whole_checkpoints(tmp_path):
    ckpts = Checkpoints(tmp_path, keep=2)
    assert ckpts.latest() is None
    for step in (1, 2, 3):
        ckpts.save(step, snapshot({"w": torch.full((2,), float(step))}), {"run_id": "r"})
    latest = ckpts.latest()
    assert latest.step == 3 and latest.meta["run_id"] == "r"
    assert torch.equal(read_state(latest.folder)["w"], torch.full((2,), 3.0))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]
    # a write cut off before its rename is a scratch folder nobody reads
    (tmp_path / ".step-00000004.partial").mkdir()
    (tmp_path / ".step-00000004.partial" / "state.pt").write_bytes(b"half")
    assert ckpts.latest().step == 3


def test_checkpoints_ahead_of_the_run_are_discarded(tmp_path):
    """After a Redis failover that lost a step, the checkpoints after the committed version go
    and LATEST names the newest one left (or nothing)."""
    ckpts = Checkpoints(tmp_path, keep=3)
    for step in (1, 2, 3):
        ckpts.save(step, snapshot({"w": torch.zeros(1)}), {})
    assert ckpts.discard_after(3).step == 3
    assert ckpts.discard_after(1).step == 1 and ckpts.latest().step == 1
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000001"]
    assert ckpts.discard_after(0) is None and ckpts.latest() is None


def test_policy_state_round_trips(tmp_path, tiny_model):
    from services.contracts.runspec import RunSpec
    from services.trainer.policy import Policy

    spec = RunSpec(model=str(tiny_model), steps=2)
    a = Policy(tiny_model, spec)
    for p in a.model.parameters():
        p.grad = torch.ones_like(p)
    a.optimizer_step()
    torch.rand(3)
    write = a.snapshot(tmp_path)
    expected_next = torch.rand(2)
    write()
    b = Policy(tiny_model, spec)
    b.restore(tmp_path)
    assert torch.equal(torch.rand(2), expected_next)  # the RNG goes on where it was
    pairs = zip(a.model.named_parameters(), b.model.named_parameters(), strict=True)
    for (na, pa), (nb, pb) in pairs:
        assert na == nb and torch.equal(pa, pb)
    assert b.optimizer.state_dict()["state"][0]["step"] == 1


def test_due_every_k_steps_or_t_seconds():
    from services.trainer.checkpoint import due

    assert not due(3, last_step=0, last_s=0.0, now_s=10.0, every=10, every_s=300.0)
    assert due(10, last_step=0, last_s=0.0, now_s=10.0, every=10, every_s=300.0)
    assert due(3, last_step=0, last_s=0.0, now_s=300.0, every=10, every_s=300.0)
    # the time rule never checkpoints the same version twice
    assert not due(3, last_step=3, last_s=0.0, now_s=900.0, every=10, every_s=300.0)


def test_a_snapshot_does_not_move_with_training(tmp_path):
    """The step copies the state; training goes on while it is written, and the checkpoint
    holds the state as it was."""
    w = torch.zeros(3)
    state = {"model": {"w": w}, "optimizer": {"state": {0: {"exp_avg": w * 2}}, "groups": [1]}}
    ckpts = Checkpoints(tmp_path)
    write = snapshot_of(state, ckpts.scratch(4))
    w += 1.0
    state["optimizer"]["state"][0]["exp_avg"] += 5.0
    write()
    copy = read_state(ckpts.commit(4, {}).folder)
    assert torch.equal(copy["model"]["w"], torch.zeros(3))
    assert torch.equal(copy["optimizer"]["state"][0]["exp_avg"], torch.zeros(3))
    assert copy["optimizer"]["groups"] == [1]


def test_the_background_writer_writes_one_at_a_time(tmp_path):
    import threading

    from services.trainer.checkpoint import BackgroundWriter

    ckpts = Checkpoints(tmp_path, keep=3)
    gate = threading.Event()

    def slow(state: dict, step: int):
        write = snapshot_of(state, ckpts.scratch(step))
        return lambda: (gate.wait(10), write())

    writer = BackgroundWriter(ckpts)
    assert writer.submit(1, slow({"w": torch.ones(1)}, 1), {})
    assert writer.busy and not writer.submit(2, slow({"w": torch.ones(2)}, 2), {})  # in flight
    assert ckpts.latest() is None  # the caller did not wait for the write
    gate.set()
    writer.close()
    assert ckpts.latest().step == 1 and writer.written == 1

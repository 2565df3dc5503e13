"""One RL step of the trainer's policy, for tests/integration/test_trainer_ranks.py:
`python -m tests.ranks.step MODEL OUT SPEC_JSON` in one process, or under
`torch.distributed.run --nproc-per-node N` as N ranks through ranks.py's leader and followers.

Rank 0 (or the one process) writes to OUT: `step0/` (version 0's files, before training),
`step1/` (the weights after a step on the seeded groups below, as a version's files),
`row1.json` (the step's metrics row), a checkpoint of that state in `ckpt/`, `step2/` +
`row2.json` after a second step taken by a policy restored from the checkpoint, then
`loaded1/` and `loaded0/`: the files of a further version after `step1/`, then `step0/`, was
loaded back into it (a committed version taken by a trainer).
"""

import json
import random
import sys
from pathlib import Path

import msgspec
import torch

from services.contracts.messages import Group, Response
from services.contracts.runspec import RunSpec
from services.trainer.export import write_files


def groups(spec: RunSpec, step: int) -> list[Group]:
    rng = random.Random(step)
    out = []
    for i in range(spec.training.prompts_per_step):
        prompt = [rng.randrange(5, 40) for _ in range(rng.randrange(3, 9))]
        responses = []
        for _ in range(spec.training.group_size):
            n = rng.randrange(1, spec.sampling.max_new_tokens + 1)
            tokens = [rng.randrange(5, 40) for _ in range(n)]
            responses.append(
                Response(
                    token_ids=tokens,
                    logprobs=[-rng.random() * 3 for _ in tokens],
                    reward=float(rng.random() < 0.5),
                    finish_reason="length",
                )
            )
        out.append(
            Group(
                run_id="r",
                step=step,
                prompt_index=i,
                prompt_ids=prompt,
                responses=responses,
            )
        )
    return out


def run(policy_of, model: Path, out: Path, spec: RunSpec) -> None:
    policy = policy_of(model, spec)
    write_files(policy.export_files(0), out / "step0")
    first = groups(spec, 0)
    policy.accumulate(first[:3])  # as groups arrive: a part, then the rest
    policy.accumulate(first[3:])
    row = policy.optimizer_step()
    write_files(policy.export_files(1), out / "step1")
    (out / "row1.json").write_bytes(msgspec.json.encode(row))
    scratch = out / "ckpt"
    scratch.mkdir()
    policy.snapshot(scratch)()
    policy = policy_of(model, spec)  # a restarted trainer
    policy.restore(scratch)
    policy.accumulate(groups(spec, 1))
    row = policy.optimizer_step()
    write_files(policy.export_files(2), out / "step2")
    (out / "row2.json").write_bytes(msgspec.json.encode(row))
    for version in (1, 0):
        policy.load_weights(out / f"step{version}")
        write_files(policy.export_files(3), out / f"loaded{version}")


def main() -> None:
    model, out, raw = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    spec = RunSpec.model_validate({"model": str(model), **json.loads(raw)})
    torch.set_num_threads(1)
    from services.trainer import ranks

    if ranks.world_size() == 1:
        from services.trainer.policy import Policy

        run(lambda m, s: Policy(m, s), model, out, spec)
        return
    ranks.init("cpu")
    if ranks.rank() != 0:
        ranks.follow()
        return
    try:
        run(lambda m, s: ranks.lead(m, s, "cpu"), model, out, spec)
    finally:
        ranks.release()


if __name__ == "__main__":
    main()

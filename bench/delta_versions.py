"""Real consecutive versions of a policy for the sparse-delta pull benchmark (issue 42), made
the way bench/delta_share.py makes them, with its helpers: the trainer's own `Policy` (its GRPO
loss, its AdamW over fp32 master weights as services/trainer/optim.py configures it, gradient
clipping) takes real steps on delta_share's synthetic groups, and each version is the trainer's
own export (`Policy.export_files`: `weight_files` + the model folder's companion files) in the
published dtype, in memory, as the weight store receives it.

The model: one of delta_share's (`qwen2-236m`, a 236M-parameter Qwen2 of random init, ~0.47 GB
in bf16, as bench/trainer.py shapes it; `embedded`, the embedded default's) or the path of a local
Hugging Face model folder. Nothing is downloaded.

It does not move bytes; bench/weight_pull.py `--delta` does.
"""

from collections.abc import Iterator
from pathlib import Path

from delta_share import STEP_SIZES, build, groups


def model_folder(name: str, work: Path, pretrain_steps: int = 50) -> Path:
    """The model `name` as a Hugging Face folder: a folder of one's own (`name` is its path),
    or a model of delta_share's built in `work`."""
    if Path(name).is_dir():
        return Path(name)
    return build(name, work / name, pretrain_steps)


class VersionMaker:
    """Versions of the model in `folder` trained by the trainer's Policy at `lr`, exported in
    `dtype` (`spec_over`: more run spec fields, e.g. LoRA's)."""

    def __init__(self, folder: Path, lr: float, dtype: str = "bfloat16", **spec_over) -> None:
        from services.contracts.runspec import RunSpec
        from services.trainer.policy import Policy

        self.sizes = STEP_SIZES["embedded" if folder.name == "embedded" else "qwen"]
        spec = RunSpec(
            model=str(folder),
            prompts_per_step=self.sizes[0],
            group_size=self.sizes[1],
            max_new_tokens=self.sizes[2],
            learning_rate=lr,
            lr_scheduler_type="constant",
            weight_dtype=dtype,
            **spec_over,
        )
        self.policy = Policy(folder, spec, "cpu")
        self.steps = 0

    def step(self) -> None:
        """One RL step of the trainer's: the loss's gradients over a step's groups, then AdamW."""
        vocab = self.policy.model.config.vocab_size
        self.policy.accumulate(groups(vocab, self.sizes, seed=self.steps))
        self.policy.optimizer_step()
        self.steps += 1

    def versions(self, count: int) -> Iterator[dict[str, bytes]]:
        """Version 0 (the weights as they are), then `count` more, one step apart: each
        version's files as the trainer exports them."""
        yield self.policy.export_files(0)
        for version in range(1, count + 1):
            self.step()
            yield self.policy.export_files(version)


def weight_names(files: dict[str, bytes]) -> list[str]:
    """The safetensors files of a version, by name."""
    return sorted(n for n in files if n.endswith(".safetensors"))


def changed_elements(old: dict[str, bytes], new: dict[str, bytes]) -> tuple[int, int]:
    """(elements changed, elements) between two versions' safetensors files."""
    from services.weights.delta import changed_fraction

    changed = total = 0
    for name in weight_names(new):
        c, t = changed_fraction(old[name], new[name])
        changed, total = changed + c, total + t
    return changed, total

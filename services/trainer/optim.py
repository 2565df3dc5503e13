"""The trainer's optimizer and learning-rate schedule, with transformers' Trainer's meanings (as
TRL's GRPOTrainer uses them): AdamW whose weight decay skips biases and norm weights, and the
constant / linear / cosine schedules with a linear warmup from 0.

The schedule counts optimizer steps: a run makes `steps x num_iterations` of them.
"""

import math

import torch

from services.contracts.runspec import RunSpec

ADAM_EPS = 1e-8  # TRL's adam_epsilon default (and torch's)


def lr_multiplier(step: int, kind: str, warmup_steps: int, total_steps: int) -> float:
    """The factor on the learning rate at optimizer step `step` (0 for the first), as
    transformers' schedules give it: `step / warmup_steps` during the warmup (so the first
    step of a warmup is at 0), then 1 (constant, constant_with_warmup), a straight line to 0
    at `total_steps` (linear), or half a cosine to 0 there (cosine)."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown lr_scheduler_type {kind!r}")


def decayed(param: torch.nn.Parameter) -> bool:
    """Whether weight decay applies: to matrices, not to biases and norm weights (1-D)."""
    return param.ndim >= 2


def build_optimizer(model: torch.nn.Module, spec: RunSpec) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if decayed(p)], "weight_decay": spec.optimizer.weight_decay},
        {"params": [p for p in params if not decayed(p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=spec.optimizer.learning_rate,
        betas=(spec.optimizer.adam_beta1, spec.optimizer.adam_beta2),
        eps=ADAM_EPS,
        # one kernel over all the parameters on a GPU; the CPU keeps torch's default
        fused=True if params and all(p.is_cuda for p in params) else None,
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, spec: RunSpec
) -> torch.optim.lr_scheduler.LambdaLR:
    total = spec.training.steps * spec.training.num_iterations

    def factor(step: int) -> float:
        return lr_multiplier(
            step, spec.optimizer.lr_scheduler_type, spec.optimizer.warmup_steps, total
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def set_schedule(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, done: int
) -> None:
    """Put a schedule (`build_scheduler`'s) and its optimizer's learning rates where they are
    after `done` optimizer steps."""
    scheduler.last_epoch = done
    groups = optimizer.param_groups
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(done)
    scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() answers

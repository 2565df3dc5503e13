"""What the trainer's passes over a step measured, and the training fields of the step's metrics
row made of them. Plain arithmetic: no model."""

from dataclasses import dataclass

from services.state.step_metrics import StepRow
from services.trainer.grpo import LossParts


@dataclass
class PassStats:
    """What one pass over the step's responses trained."""

    sequences: int = 0
    tokens: int = 0  # generated response tokens: observation tokens are never trained
    policy_loss: float = 0.0  # sums over sequences
    kl: float = 0.0
    clipped_tokens: float = 0.0

    def add(self, parts: LossParts, n_seq: int) -> None:
        self.policy_loss += parts.policy * n_seq
        self.kl += parts.kl * n_seq
        self.clipped_tokens += parts.clip_fraction * parts.tokens
        self.sequences += n_seq
        self.tokens += parts.tokens

    def mean(self, total: float) -> float:
        return total / max(1, self.sequences)


def step_row(passes: list[PassStats], grad_norms: list[float]) -> StepRow:
    """The training fields of a step's metrics row: losses, clip fraction and gradient norm are
    means over its optimizer steps (num_iterations of them); sequences and tokens are the
    step's, counted once. Losses are means over sequences, the clip fraction over tokens."""
    n = len(passes)
    return StepRow(
        policy_loss=sum(p.mean(p.policy_loss) for p in passes) / n,
        kl=sum(p.mean(p.kl) for p in passes) / n,
        clip_fraction=sum(p.clipped_tokens / max(1, p.tokens) for p in passes) / n,
        grad_norm=sum(grad_norms) / len(grad_norms),
        trained_sequences=passes[0].sequences,
        trained_tokens=passes[0].tokens,
    )

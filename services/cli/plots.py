"""A PNG of a run's per-step metrics: reward and rollout throughput over steps."""

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from services.infra import figures
from services.state.step_metrics import row_from_values


def plot_run(rows: Iterable[Mapping[str, Any]], out: Path, title: str = "") -> Path:
    """`rows` as the coordinator's API returns them (GET /v1/runs/{id}/metrics); the steps
    whose rollout is done are drawn."""
    typed = [row_from_values(row, row.get("step")) for row in rows]
    done = [row for row in typed if row.reward_mean is not None]
    steps = [row.step for row in done]
    rewards = [row.reward_mean for row in done]
    tps = [row.tokens_per_s or 0.0 for row in done]
    plt = figures.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(steps, rewards, marker=".", color="tab:green")
    top.set_ylabel("mean reward")
    top.set_ylim(0, 1.05)
    top.grid(alpha=0.3)
    bottom.plot(steps, tps, marker=".", color="tab:blue")
    bottom.set_ylabel("rollout tokens/s")
    bottom.set_xlabel("RL step")
    bottom.grid(alpha=0.3)
    return figures.save(fig, out, title)

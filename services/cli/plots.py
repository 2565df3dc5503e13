"""A PNG of a run's per-step metrics: reward and rollout throughput over steps."""

from pathlib import Path

from services.common import figures


def plot_run(rows: list[dict], out: Path, title: str = "") -> Path:
    plt = figures.pyplot()
    steps = [row["step"] for row in rows if "reward_mean" in row]
    rewards = [row["reward_mean"] for row in rows if "reward_mean" in row]
    tps = [row.get("tokens_per_s", 0.0) for row in rows if "reward_mean" in row]
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

"""A PNG of a run's per-step metrics: reward and rollout throughput over steps."""

from pathlib import Path


def plot_run(rows: list[dict], out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

"""A PNG of a comparison: effective throughput over time for each system (tokens trained per
second in a sliding window of steps), with the spot instances the trace offered beneath."""

from pathlib import Path

from services.infra import figures
from services.sim.compare import Comparison

WINDOW_STEPS = 5


def plot_throughput(comparison: Comparison, out: Path, title: str = "") -> Path:
    plt = figures.pyplot()
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    for name, sim in comparison.sims.items():
        rows = sim.records
        hours, rates = [], []
        for i in range(len(rows)):
            first = rows[max(0, i - WINDOW_STEPS + 1)]
            span = rows[i].end_s - first.start_s
            tokens = sum(r.tokens for r in rows[max(0, i - WINDOW_STEPS + 1) : i + 1])
            hours.append(rows[i].end_s / 3600)
            rates.append(tokens / span if span > 0 else 0.0)
        style = "-" if name.startswith("hybrid") else "--"
        top.plot(hours, rates, style, label=name, linewidth=1.4)
    top.set_ylabel(f"tokens trained / s\n(last {WINDOW_STEPS} steps)")
    top.grid(alpha=0.3)
    top.legend(fontsize=8, ncol=2)
    hybrid = comparison.sims.get("hybrid")
    if hybrid is not None and hybrid.fleet.spot_timeline:
        times = [t / 3600 for t, _ in hybrid.fleet.spot_timeline]
        counts = [n for _, n in hybrid.fleet.spot_timeline]
        end = max(times[-1], max((r.end_s for r in hybrid.records), default=0) / 3600)
        bottom.step([*times, end], [*counts, counts[-1]], where="post", color="tab:gray")
    bottom.set_ylabel("spot instances")
    bottom.set_xlabel("hours")
    bottom.grid(alpha=0.3)
    return figures.save(fig, out, title)

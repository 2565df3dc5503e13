"""matplotlib without a display: the pyplot module on the file-only backend, and saving a figure
the way every spotrl plot does."""

from pathlib import Path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, out: Path, title: str = "") -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    pyplot().close(fig)
    return out

"""The bench's plot: step-time ratio against the work a crash loses, one point per method.

matplotlib is the optional extra `bench` (pip install -e '.[bench]'); `require_matplotlib` says so
in one line before any measurement starts.
"""

from __future__ import annotations

from ..errors import CxlTrainError
from .results import BenchResults


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CxlTrainError("--plot needs matplotlib: pip install -e '.[bench]' (or make bench-extras)") from None


def points(results: BenchResults) -> list[tuple[str, float, int]]:
    """(label, step-time ratio, batches lost) of every measured method that loses a bounded number of
    batches, at the first pooling (the methods that lose everything have no place on a log axis)."""
    first = results.steps[0].pooling
    return [(r.label, r.timing.ratio, r.timing.batches_lost) for r in results.steps
            if r.pooling == first and r.timing is not None and r.timing.ratio is not None
            and r.timing.batches_lost is not None]


def save_plot(results: BenchResults, path: str) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    measured = sorted(points(results), key=lambda point: point[1])
    for label, ratio, lost in measured:
        ax.scatter([lost], [ratio], s=40)
    ax.set_xscale("log")
    ax.set_yscale("log")
    for label, ratio, lost, (dx, dy) in zip(*zip(*measured), _label_offsets(ax, measured)):
        ax.annotate(label, (lost, ratio), textcoords="offset points", xytext=(dx, dy), fontsize=8,
                    arrowprops=dict(arrowstyle="-", color="grey", linewidth=0.5) if dy > 6 else None)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("batches a crash can lose (log)")
    ax.set_ylabel("step time / no checkpoint (log)")
    m = results.machine
    ax.set_title(f"{m.cpu}, {m.threads} threads", fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise CxlTrainError(f"{path}: cannot write the plot: {e.strerror}") from None
    finally:
        plt.close(fig)


# Labels nearer than this (points) to a lower one at about the same x move up: methods that cost
# about the same (ours, at ratios near 1) would otherwise print over each other.
_LABEL_GAP = 10
_LABEL_SAME_X = 60


def _label_offsets(ax, measured: list) -> list[tuple[float, float]]:
    """(dx, dy) in points from each point (sorted by ratio) to its label, stacking close labels."""
    to_points = 72.0 / ax.figure.dpi
    placed: list[tuple[float, float]] = []  # (x, label y) in points, from the bottom up
    offsets = []
    for _, ratio, lost in measured:
        x, y = (value * to_points for value in ax.transData.transform((lost, ratio)))
        label_y = y + 4
        for other_x, other_y in placed:
            if abs(other_x - x) < _LABEL_SAME_X:
                label_y = max(label_y, other_y + _LABEL_GAP)
        placed.append((x, label_y))
        offsets.append((6.0, label_y - y))
    return offsets

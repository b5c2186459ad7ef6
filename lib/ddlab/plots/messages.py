"""Data movement between ranks (labs 02-03) and times against message size (labs 02, 05)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from .alt import describe, subplots
from .helpers import rank_colour, size_axis


def _draw_ranks(ax: plt.Axes, arrays: Sequence[np.ndarray | None], width: int, combined: bool) -> None:
    """One row per rank, one cell per element; colour = the rank the value came from."""
    for rank, array in enumerate(arrays):
        y = len(arrays) - 1 - rank
        if array is None:
            ax.text(-0.4, y, "None", va="center", fontsize=9, style="italic", color="gray")
            continue
        for i, value in enumerate(np.ravel(array)):
            if value < 0:  # a slot not filled yet
                ax.add_patch(plt.Rectangle((i - 0.45, y - 0.4), 0.9, 0.8, fc="white", ec="gray", ls="--"))
                continue
            if combined:  # a sum over all ranks: a stripe of every rank's colour
                stripe = 0.9 / len(arrays)
                for source in range(len(arrays)):
                    ax.add_patch(
                        plt.Rectangle(
                            (i - 0.45 + source * stripe, y - 0.4),
                            stripe,
                            0.8,
                            fc=rank_colour(source),
                            ec="none",
                            alpha=0.6,
                        )
                    )
                ax.add_patch(plt.Rectangle((i - 0.45, y - 0.4), 0.9, 0.8, fc="none", ec="black"))
            else:
                origin = int(value) // 10
                colour = rank_colour(origin) if origin < len(arrays) else "lightgray"
                ax.add_patch(plt.Rectangle((i - 0.45, y - 0.4), 0.9, 0.8, fc=colour, ec="black", alpha=0.85))
            ax.text(
                i,
                y,
                f"{value:g}",
                ha="center",
                va="center",
                fontsize=8,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"} if combined else None,
            )
    ax.set_xlim(-0.6, max(width, 1) - 0.4)
    ax.set_ylim(-0.6, len(arrays) - 0.4)
    ax.set_yticks(range(len(arrays)), [f"rank {r}" for r in reversed(range(len(arrays)))])
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)


def data_movement(
    before: Sequence[np.ndarray | None],
    after: Sequence[np.ndarray | None],
    title: str,
    combined: bool = False,
    *,
    alt: str,
) -> plt.Figure:
    """Every rank's array before and after a collective, side by side.

    Values are read as labels 10 * rank + index, so each cell takes the colour of the
    rank the value started on. Negative values are slots not filled yet (dashed);
    None is a rank that holds nothing. With `combined`, the values after are sums
    over ranks (reduce, allreduce) and are drawn striped in every rank's colour.
    """
    widths = [max([np.size(a) for a in arrays if a is not None], default=1) for arrays in (before, after)]
    fig, axes = subplots(
        1,
        2,
        figsize=(2.5 + 0.55 * sum(widths), 0.9 + 0.45 * len(before)),
        gridspec_kw={"width_ratios": [max(w, 2) for w in widths]},
    )
    for ax, arrays, width, label in zip(axes, (before, after), widths, ("before", "after")):
        _draw_ranks(ax, arrays, width, combined and label == "after")
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return describe(fig, alt)


def time_vs_size(nbytes: Sequence[float], panels: dict[str, dict[str, Sequence[float]]], *, alt: str) -> plt.Figure:
    """Time against message size (log-log), one panel per title, one line per algorithm."""
    fig, axes = subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items()):
        for label, seconds in lines.items():
            ax.loglog(nbytes, np.asarray(seconds) * 1e6, "o-", ms=4, label=label)
        size_axis(ax, nbytes, "array size")
        ax.set_ylabel("time (microseconds)")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return describe(fig, alt)

"""Lab 06's figures: memory against image size, per-layer bars."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..plots.alt import describe, subplots


def memory_fit(
    sides: Sequence[int],
    peaks: dict[str, Sequence[Sequence[float]]],
    budget: float,
    fits: dict[str, Sequence[bool]],
    *,
    alt: str,
) -> plt.Figure:
    """Largest per-rank peak memory against image side, one line per split, the budget as a line; x marks OOM.

    peaks[split][i]: the ranks' peak bytes at sides[i].
    """
    fig, ax = subplots(figsize=(6.5, 3.6))
    for split, per_side in peaks.items():
        worst = np.array([max(p) / 2**20 for p in per_side])
        (line,) = ax.plot(sides, worst, "o-", ms=4, label=split)
        failed = ~np.asarray(fits[split], dtype=bool)
        ax.plot(np.asarray(sides)[failed], worst[failed], "x", ms=9, mew=2, color=line.get_color())
    ax.axhline(budget / 2**20, color="black", ls="--", lw=1, label="budget per rank")
    ax.set_xlabel("image side (pixels)")
    ax.set_ylabel("largest peak over ranks (MiB)")
    ax.set_title("Memory of the fullest rank; x: out of memory (peak when it stopped)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return describe(fig, alt)


def per_layer_bars(
    names: Sequence[str],
    values: dict[str, Sequence[float]],
    ylabel: str,
    title: str = "",
    bounds: Sequence[int] | None = None,
    *,
    alt: str,
) -> plt.Figure:
    """Stacked bars, one per layer (e.g. parameter and activation bytes); dashed lines at stage bounds."""
    fig, ax = subplots(figsize=(max(7.0, 0.3 * len(names)), 3.4))
    bottom = np.zeros(len(names))
    for label, series in values.items():
        ax.bar(range(len(names)), series, bottom=bottom, label=label)
        bottom += np.asarray(series, dtype=float)
    for cut in (bounds or [])[1:-1]:
        ax.axvline(cut - 0.5, color="black", ls="--", lw=1)
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return describe(fig, alt)

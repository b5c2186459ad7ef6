"""Figures of lab 15's experts: tokens routed to experts on ranks, and the load each expert gets."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..plots.alt import describe, subplots
from ..plots.helpers import rank_colour


def routing(
    expert: Sequence[np.ndarray], kept: Sequence[np.ndarray], n_experts: int, title: str = "", *, alt: str
) -> plt.Figure:
    """Each rank's tokens (left, a colour per rank) to their experts (right, grouped by the rank holding them).

    expert[r][i]: the expert token i of rank r chose (k = 1); kept[r][i]: False if it was dropped
    at capacity (drawn as a grey dash ending in a cross, before the expert). A line that crosses
    between rank groups is a row the all-to-all carries.
    """
    size = len(expert)
    per_rank = n_experts // size
    fig, ax = subplots(figsize=(7, 4.2))
    total = sum(len(e) for e in expert)
    token_y = np.linspace(0, 1, max(total, 2))
    expert_y = np.linspace(0.05, 0.95, n_experts)
    i = 0
    for r, (chosen, fits) in enumerate(zip(expert, kept)):
        for e, ok in zip(np.asarray(chosen), np.asarray(fits)):
            start, end = (0.0, token_y[i]), (1.0, expert_y[e])
            if ok:
                ax.plot([start[0], end[0]], [start[1], end[1]], color=rank_colour(r), lw=0.9, alpha=0.8)
            else:
                mid = (0.7, start[1] + 0.7 * (end[1] - start[1]))
                ax.plot([start[0], mid[0]], [start[1], mid[1]], color="grey", lw=0.8, ls="--")
                ax.plot(*mid, "x", color="tab:red", ms=6)
            ax.plot(*start, "o", color=rank_colour(r), ms=4)
            i += 1
    for e in range(n_experts):
        owner = e // per_rank
        ax.plot(1.0, expert_y[e], "s", ms=12, color=rank_colour(owner), mec="black")
        ax.text(1.04, expert_y[e], f"expert {e} (rank {owner})", va="center", fontsize=8)
    ax.text(0.0, 1.06, "tokens, by rank", ha="center", fontsize=9)
    ax.set_xlim(-0.1, 1.45)
    ax.set_ylim(-0.05, 1.12)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return describe(fig, alt)


def expert_load(
    loads: dict[str, np.ndarray], capacity: float | None = None, title: str = "", *, alt: str
) -> plt.Figure:
    """Assignments per expert for each labelled run, side by side, and the capacity as a line."""
    fig, ax = subplots(figsize=(6.5, 3.2))
    width = 0.8 / max(len(loads), 1)
    for j, (label, load) in enumerate(loads.items()):
        load = np.asarray(load, dtype=float)
        ax.bar(
            np.arange(len(load)) + (j - (len(loads) - 1) / 2) * width,
            load,
            width,
            label=f"{label} (max/mean {load.max() / load.mean():.2f})",
        )
    if capacity is not None:
        ax.axhline(capacity, color="tab:red", ls="--", lw=1, label=f"capacity {capacity:g}")
    ax.set_xticks(range(max((len(load) for load in loads.values()), default=0)))
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return describe(fig, alt)

"""Drawing helpers the figures share: boxes and arrows, byte-size axes, a colour per rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import to_rgba
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch


def box(ax: plt.Axes, x: float, y: float, w: float, h: float, text: str, color: str) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="black"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)


def arrow(ax: plt.Axes, start: tuple[float, float], end: tuple[float, float], **style: Any) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10, **style))


def byte_label(n: float) -> str:
    """8 B, 64 KiB, 16 MiB: a power-of-two byte count for an axis tick."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:g} B"


def size_axis(
    ax: plt.Axes, sizes: Sequence[float] | np.ndarray, label: str, every: int = 3, legend_size: int = 8
) -> None:
    """A log x-axis of byte sizes: power-of-two ticks named in B/KiB/MiB, a grid, the legend."""
    ticks = [2**k for k in range(0, 40, every) if min(sizes) <= 2**k <= max(sizes)]
    ax.set_xticks(ticks, [byte_label(k) for k in ticks], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel(label)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=legend_size)


def finish_panels(fig: plt.Figure, axes: Sequence[plt.Axes], xlabel: str, title: str) -> plt.Figure:
    """Side-by-side panels sharing an x quantity: each gets the label, a grid and its legend; one title above."""
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


#: A colour per rank: Okabe and Ito's, and a dark grey, told apart with any common colour-vision deficiency.
RANK_COLOURS = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#555555")


def rank_colour(rank: int) -> tuple[float, float, float, float]:
    """The colour of a rank (cycling after 8), as RGBA."""
    return to_rgba(RANK_COLOURS[rank % len(RANK_COLOURS)])

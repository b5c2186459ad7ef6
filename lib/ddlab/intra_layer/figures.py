"""Lab 08's figure: an image cut into slabs of rows, and the halo rows each slab borrows."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from ..plots.alt import describe, subplots


def plot_slabs(bounds: list[int], halo: int, width: int = 16, *, alt: str) -> Any:
    """Each rank's slab (bounds[r] to bounds[r+1]) in its colour, and beside it the slab with its halos hatched."""
    fig, axes = subplots(1, 2, figsize=(9, 4), sharey=True)
    height, colours = bounds[-1], plt.get_cmap("tab10")
    for rank, (a, b) in enumerate(zip(bounds, bounds[1:])):
        colour = colours(rank % 10)
        axes[0].add_patch(Rectangle((0, a), width, b - a, color=colour, alpha=0.6))
        axes[0].text(width / 2, (a + b) / 2, f"rank {rank}: rows {a}-{b - 1}", ha="center", va="center")
        left = rank * (width + 4)
        axes[1].add_patch(Rectangle((left, a), width, b - a, color=colour, alpha=0.6))
        for start, neighbour in ((a - halo, rank - 1), (b, rank + 1)):
            if 0 <= neighbour < len(bounds) - 1:
                axes[1].add_patch(
                    Rectangle(
                        (left, start),
                        width,
                        halo,
                        facecolor=colours(neighbour % 10),
                        alpha=0.35,
                        hatch="///",
                        edgecolor="black",
                    )
                )
    axes[0].set(xlim=(0, width), title=f"the image: {len(bounds) - 1} slabs of rows")
    axes[1].set(
        xlim=(0, len(bounds[1:]) * (width + 4)),
        xticks=[],
        title=f"what each rank holds: its slab + {halo}-row halos (hatched)",
    )
    for ax in axes:
        ax.set_ylim(height, 0)
    axes[0].set_ylabel("row")
    fig.tight_layout()
    return describe(fig, alt)

"""Lab 15's figures: the key/value blocks moving round the ring, and the two layouts under the causal mask."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import to_hex

from ..plots.alt import describe, subplots
from ..plots.helpers import arrow, box, rank_colour
from .layout import all_positions, causal_work


def ring_steps(size: int = 4, *, alt: str) -> plt.Figure:
    """One row per step: each rank's queries (its colour) meet the key/value block it holds (its owner's colour)."""
    fig, ax = subplots(figsize=(1.9 * size + 1, 1.0 * size + 0.6))
    for step in range(size):
        y = size - 1 - step
        ax.text(-0.35, y + 0.35, f"step {step}", ha="right", va="center", fontsize=9)
        for rank in range(size):
            owner = (rank - step) % size
            x = 1.9 * rank
            box(ax, x, y + 0.1, 0.7, 0.5, f"Q{rank}", to_hex(rank_colour(rank)))
            box(ax, x + 0.8, y + 0.1, 0.7, 0.5, f"KV{owner}", to_hex(rank_colour(owner)))
            if step < size - 1 and rank < size - 1:
                arrow(ax, (x + 1.15, y + 0.08), (x + 1.9 + 1.15, y - 0.35), color="grey")
            elif step < size - 1:  # the last rank's block wraps round to rank 0
                arrow(ax, (x + 1.15, y + 0.08), (x + 1.75, y - 0.2), color="grey")
                ax.text(x + 1.8, y - 0.2, "to\nrank 0", fontsize=7, va="center")
                arrow(ax, (-0.25, y - 0.2), (0.95, y - 0.35), color="grey")
    for rank in range(size):
        ax.text(1.9 * rank + 0.75, size + 0.05, f"rank {rank}", ha="center", fontsize=10, weight="bold")
    ax.set_xlim(-1.3, 1.9 * size + 0.3)
    ax.set_ylim(-0.5, size + 0.4)
    ax.axis("off")
    ax.set_title("Ring attention: each step a rank sends the K/V block it holds to the next rank while it computes")
    fig.tight_layout()
    return describe(fig, alt)


def layouts(length: int = 16, size: int = 4, *, alt: str) -> plt.Figure:
    """The causal score matrix coloured by the rank that computes each row, contiguous vs zig-zag, with each rank's work."""
    fig, axes = subplots(1, 2, figsize=(10, 4.6))
    for ax, zigzag in zip(axes, (False, True)):
        positions = all_positions(length, size, zigzag)
        picture = np.ones((length, length, 4))
        for rank, mine in enumerate(positions):
            for row in mine[mine < length]:
                picture[row, : row + 1] = rank_colour(rank)
        ax.imshow(picture, interpolation="nearest")
        work = causal_work(positions)
        name = "zig-zag: chunks r and 2P-1-r" if zigzag else "contiguous: one stretch per rank"
        ax.set_title(f"{name}\nscores per rank {work.tolist()}, max/mean {work.max() / work.mean():.2f}", fontsize=10)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    handles = [plt.Rectangle((0, 0), 1, 1, color=rank_colour(r)) for r in range(size)]
    fig.legend(handles, [f"rank {r}" for r in range(size)], loc="lower center", ncol=size, frameon=False)
    fig.suptitle(f"Who computes which scores under the causal mask ({length} positions, {size} ranks)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return describe(fig, alt)

"""Lab 00: the cluster a notebook drives."""

from __future__ import annotations

import matplotlib.pyplot as plt

from .alt import describe, subplots
from .helpers import arrow, box


def cluster_diagram(n_engines: int = 4, *, alt: str) -> plt.Figure:
    """Notebook -> controller -> engines, with the MPI messages between engines."""
    fig, ax = subplots(figsize=(7, 3.2))
    width = 1.2 * n_engines
    box(ax, width / 2 - 0.7, 2.4, 1.4, 0.5, "notebook\n(kernel)", "#e8f0fe")
    box(ax, width / 2 - 0.7, 1.4, 1.4, 0.5, "controller", "#fde9d9")
    arrow(ax, (width / 2, 2.4), (width / 2, 1.9))
    for rank in range(n_engines):
        x = rank * 1.2 + 0.1
        box(ax, x, 0.2, 1.0, 0.55, f"engine {rank}\nMPI rank {rank}", "#e6f4ea")
        arrow(ax, (width / 2, 1.4), (x + 0.5, 0.75), color="gray")
        if rank + 1 < n_engines:
            arrow(ax, (x + 1.0, 0.35), (x + 1.2, 0.35), color="tab:red")
    ax.text(width - 0.1, 0.05, "red: MPI messages between ranks", ha="right", fontsize=8, color="tab:red")
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(0, 3.0)
    ax.axis("off")
    ax.set_title(f"One MPI job of {n_engines} engines, driven from this notebook", fontsize=10)
    return describe(fig, alt)

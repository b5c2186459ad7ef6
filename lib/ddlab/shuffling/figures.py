"""Figures of lab 12: the exchange plan, the diagram of a redistribution, bytes per strategy, the I/O model, equal wall-clock runs."""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..plots.alt import describe, subplots
from ..plots.helpers import finish_panels


def exchange_matrix(sends: np.ndarray, title: str = "", *, alt: str) -> plt.Figure:
    """Samples rank r sends to rank d (row r, column d): the plan of one epoch."""
    sends = np.asarray(sends)
    fig, ax = subplots(figsize=(3.6, 3.2))
    image = ax.imshow(sends, cmap="Blues")
    middle = (sends.min() + sends.max()) / 2  # of the colour scale, which runs from the least to the most
    for (r, d), value in np.ndenumerate(sends):
        ax.text(
            d,
            r,
            str(value),
            ha="center",
            va="center",
            fontsize=9,
            color="white" if value > middle else "black",
        )
    ax.set_xticks(range(len(sends)))
    ax.set_yticks(range(len(sends)))
    ax.set_xlabel("to rank")
    ax.set_ylabel("from rank")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    return describe(fig, alt)


def diagram(holds: Sequence[np.ndarray], needs: Sequence[np.ndarray], title: str = "", *, alt: str) -> plt.Figure:
    """Which sample ids each rank holds (left) and needs, in order (right); a cell's colour is the rank holding it."""
    size = len(holds)
    owner = {int(i): r for r, ids in enumerate(holds) for i in ids}
    colours = plt.get_cmap("tab10")
    width = max(max((len(ids) for ids in layout), default=1) for layout in (holds, needs))
    fig, axes = subplots(1, 2, figsize=(2.2 + 0.9 * width, 0.9 + 0.5 * size), sharey=True)
    for ax, layout, label in zip(axes, (holds, needs), ("holds (row order of x)", "needs (in this order)")):
        for r, ids in enumerate(layout):
            for j, i in enumerate(ids):
                ax.add_patch(plt.Rectangle((j, r), 0.92, 0.86, color=colours(owner[int(i)] % 10), alpha=0.55))
                ax.text(j + 0.46, r + 0.43, str(int(i)), ha="center", va="center", fontsize=9)
        ax.set_xlim(0, width)
        ax.set_ylim(size, 0)
        ax.set_yticks([r + 0.43 for r in range(size)], [f"rank {r}" for r in range(size)])
        ax.set_xticks([])
        ax.set_title(label, fontsize=10)
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return describe(fig, alt)


def loss_and_bytes(
    losses: dict[str, Sequence[float]],
    moved: dict[str, dict[str, float]],
    title: str = "",
    *,
    alt: str,
) -> plt.Figure:
    """Left: validation loss per epoch per strategy. Right: bytes each strategy took from each source."""
    fig, (left, right) = subplots(1, 2, figsize=(11, 3.6))
    for label, values in losses.items():
        left.plot(np.arange(1, len(values) + 1), values, "o-", ms=3, label=label)
    left.set_yscale("log")
    left.set_xlabel("epoch")
    left.set_ylabel("validation MSE")
    left.legend(fontsize=8)
    labels = list(moved)
    bottom = np.zeros(len(labels))
    for source, colour in (("shared", "tab:red"), ("exchanged", "tab:orange"), ("local", "tab:green")):
        megabytes = np.array([moved[label][source] for label in labels]) / 1e6
        right.bar(labels, megabytes, bottom=bottom, label=source, color=colour)
        bottom += megabytes
    right.set_ylabel("MB over the run")
    right.legend(fontsize=8)
    right.tick_params(axis="x", labelsize=8, rotation=20)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return describe(fig, alt)


def io_model(
    ranks: np.ndarray,
    times: dict[str, np.ndarray],
    compute: np.ndarray,
    crossover: float,
    title: str = "",
    *,
    alt: str,
) -> plt.Figure:
    """Seconds per epoch of reading, per strategy, and of computing, against ranks (log-log)."""
    fig, ax = subplots(figsize=(6.5, 3.8))
    for label, values in times.items():
        ax.plot(ranks, values, label=label)
    ax.plot(ranks, compute, "k--", label="compute (perfect scaling)")
    ax.axvline(crossover, color="grey", lw=0.8)
    ax.text(crossover, compute.min(), f" P = {crossover:.0f}", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("seconds per epoch")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return describe(fig, alt)


def equal_time(results: dict[str, list[dict]], title: str = "", *, alt: str) -> plt.Figure:
    """Left: seconds per epoch against the global batch. Right: validation loss after the same wall-clock, per rule."""
    fig, (left, right) = subplots(1, 2, figsize=(11, 3.6))
    for rule, runs in results.items():
        batches = [r["global_batch"] for r in runs]
        left.plot(batches, [r["epoch_time"] for r in runs], "o-", label=rule)
        right.plot(batches, [r["val_loss"] for r in runs], "o-", label=rule)
    left.set_ylabel("seconds per epoch")
    right.set_ylabel("validation MSE after the budget")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xscale("log")
    return describe(finish_panels(fig, (left, right), "global batch size", title), alt)

"""Lab 06: the UNet split over ranks, memory against image size, per-rank and per-layer bars."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch

from ._helpers import _box

_STAGE_COLOURS = ("#a6cee3", "#fdbf6f", "#b2df8a", "#fb9a99", "#cab2d6", "#ffff99", "#1f78b4", "#33a02c")


def unet_diagram(names: Sequence[str], bounds: Sequence[int] | None = None, title: str = "") -> plt.Figure:
    """The UNet's layers in a U (depth goes down), skip connections as arrows; coloured by stage if bounds given.

    names: layer names as ddlab.models.unet.layer_names gives them ('Conv', 'Down0', 'Up0', 'Head').
    """
    level, places = 0, []
    for name in names:
        places.append(level)
        level += name.startswith("Down") - name.startswith("Up")
    fig, ax = plt.subplots(figsize=(max(7.0, 0.36 * len(names)), 3.4))
    stage_of = [0] * len(names)
    if bounds is not None:
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            stage_of[a:b] = [s] * (b - a)
    for i, (name, depth) in enumerate(zip(names, places)):
        colour = _STAGE_COLOURS[stage_of[i] % len(_STAGE_COLOURS)] if bounds is not None else "#e8f0fe"
        _box(ax, i - 0.4, -depth - 0.3, 0.8, 0.6, name[0], colour)
        if i:
            ax.plot([i - 0.6, i - 0.4], [-places[i - 1], -depth], color="gray", lw=1)
    for i, name in enumerate(names):
        if name.startswith("Down"):
            j = names.index("Up" + name[4:])
            ax.add_patch(FancyArrowPatch((i, -places[i] + 0.32), (j, -places[j] + 0.32), arrowstyle="-|>",
                                         mutation_scale=10, connectionstyle="arc3,rad=-0.12", color="tab:red"))
    if bounds is not None:
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            ax.text((a + b - 1) / 2, 1.05, f"stage {s}", ha="center", fontsize=9,
                    bbox=dict(fc=_STAGE_COLOURS[s % len(_STAGE_COLOURS)], ec="none"))
    ax.text(-0.5, -max(places) - 0.55, "C conv+ReLU   D store skip, pool   U upsample, concat skip   H head",
            fontsize=8)
    ax.text(len(names) - 0.5, -max(places) - 0.55, "red: skip connections", ha="right", fontsize=8, color="tab:red")
    ax.set_xlim(-0.7, len(names) - 0.3)
    ax.set_ylim(-max(places) - 0.7, 1.4)
    ax.axis("off")
    ax.set_title(title or "UNet: encoder down, decoder up, skips across", fontsize=10)
    return fig


def memory_fit(sides: Sequence[int], peaks: dict[str, Sequence[Sequence[float]]], budget: float,
               fits: dict[str, Sequence[bool]]) -> plt.Figure:
    """Largest per-rank peak memory against image side, one line per split, the budget as a line; x marks OOM.

    peaks[split][i]: the ranks' peak bytes at sides[i].
    """
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for split, per_side in peaks.items():
        worst = np.array([max(p) / 2**20 for p in per_side])
        line, = ax.plot(sides, worst, "o-", ms=4, label=split)
        failed = ~np.asarray(fits[split], dtype=bool)
        ax.plot(np.asarray(sides)[failed], worst[failed], "x", ms=9, mew=2, color=line.get_color())
    ax.axhline(budget / 2**20, color="black", ls="--", lw=1, label="budget per rank")
    ax.set_xlabel("image side (pixels)")
    ax.set_ylabel("largest peak over ranks (MiB)")
    ax.set_title("Memory of the fullest rank; x: out of memory (peak when it stopped)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def rank_bars(values: dict[str, Sequence[float]], ylabel: str, title: str = "") -> plt.Figure:
    """Grouped bars: one group per rank, one bar per label (e.g. peak activations, GPipe vs 1F1B)."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    labels = list(values)
    ranks = len(next(iter(values.values())))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        ax.bar(np.arange(ranks) + (i - (len(labels) - 1) / 2) * width, values[label], width, label=label)
    ax.set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def per_layer_bars(names: Sequence[str], values: dict[str, Sequence[float]], ylabel: str, title: str = "",
                   bounds: Sequence[int] | None = None) -> plt.Figure:
    """Stacked bars, one per layer (e.g. parameter and activation bytes); dashed lines at stage bounds."""
    fig, ax = plt.subplots(figsize=(max(7.0, 0.3 * len(names)), 3.4))
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
    return fig

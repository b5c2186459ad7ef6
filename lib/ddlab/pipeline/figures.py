"""Lab 07's figures: per-rank bars, the measured bubble against theory."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..plots.alt import describe, subplots


def rank_bars(values: dict[str, Sequence[float]], ylabel: str, title: str = "", *, alt: str) -> plt.Figure:
    """Grouped bars: one group per rank, one bar per label (e.g. peak activations, GPipe vs 1F1B)."""
    fig, ax = subplots(figsize=(6, 3.4))
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
    return describe(fig, alt)


def bubble_vs_theory(
    micro_batches: Sequence[int], measured: dict[str, Sequence[float]], stages: int, *, alt: str
) -> plt.Figure:
    """Measured bubble fraction against micro-batches, with the theory (K-1)/(M+K-1)."""
    fig, ax = subplots(figsize=(6, 3.5))
    m = np.asarray(micro_batches, dtype=float)
    fine = np.linspace(m.min(), m.max(), 200)
    ax.plot(fine, (stages - 1) / (fine + stages - 1), "k--", lw=1, label=f"(K-1)/(M+K-1), K={stages}")
    for label, values in measured.items():
        ax.plot(m, values, "o-", ms=5, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(m, [str(int(v)) for v in m])
    ax.minorticks_off()
    ax.set_ylim(0, 1)
    ax.set_xlabel("micro-batches per step, M")
    ax.set_ylabel("bubble (idle share)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return describe(fig, alt)

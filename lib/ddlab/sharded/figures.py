"""Lab 13's figure: who holds what, per rank, at each ZeRO stage."""

from __future__ import annotations

from typing import Mapping

import matplotlib.pyplot as plt

from ..plots.alt import describe, subplots

PARTS = ("parameters", "gradients", "optimizer")


def who_holds_what(
    measured: Mapping[str, Mapping[str, float]], paper: Mapping[str, float], ranks: int, *, alt: str
) -> plt.Figure:
    """Stacked bars of bytes per parameter held by one rank (measured by the ledger), per stage; paper's totals as marks.

    measured: {stage name: {part: bytes per parameter}}; paper: {stage name: bytes per parameter}.
    """
    fig, ax = subplots(figsize=(7, 3.8))
    names = list(measured)
    bottom = [0.0] * len(names)
    for i, part in enumerate(PARTS):
        values = [measured[name].get(part, 0.0) for name in names]
        ax.bar(names, values, bottom=bottom, color=f"C{i}", label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(
        names, [paper[name] for name in names], marker="_", s=900, color="black", zorder=3, label="ZeRO paper's total"
    )
    ax.set_ylabel("bytes per parameter on one rank")
    ax.set_title(f"Model state per rank after a step, {ranks} ranks, Adam in mixed precision")
    ax.legend(frameon=False)
    fig.tight_layout()
    return describe(fig, alt)

"""Lab 18's figures: loss curves per recipe, a reduction's error against P beside its bound."""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt

from ..plots.alt import describe, subplots


def loss_curves(
    curves: Mapping[str, Sequence[float]], title: str = "The lab's GPT under each recipe", *, alt: str
) -> plt.Figure:
    """One training-loss curve per recipe, on one axis."""
    fig, ax = subplots(figsize=(7, 3.8))
    for i, (name, losses) in enumerate(curves.items()):
        ax.plot(range(len(losses)), losses, color=f"C{i}", label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return describe(fig, alt)


def error_vs_ranks(
    measured: Mapping[str, Mapping[int, float]], bound: Mapping[str, Mapping[int, float]], *, alt: str
) -> plt.Figure:
    """Largest relative error of a rounded reduction against P per format (dots), its bound (dashed)."""
    fig, ax = subplots(figsize=(6, 3.6))
    # an exact sum (error 0, float32 on one rank) has no place on a log axis: drawn open at a floor below the rest
    positive = [v for curves in (measured, bound) for per in curves.values() for v in per.values() if v > 0]
    floor = min(positive, default=1.0) / 10
    for i, name in enumerate(measured):
        ranks = sorted(measured[name])
        errors = [max(measured[name][p], floor) for p in ranks]
        filled = [k for k, p in enumerate(ranks) if measured[name][p] > 0]
        ax.plot(ranks, errors, "o-", markevery=filled, color=f"C{i}", label=f"{name}, measured")
        exact = [p for p in ranks if measured[name][p] == 0]
        if exact:
            ax.plot(
                exact, [floor] * len(exact), "o", color=f"C{i}", markerfacecolor="white", label=f"{name}: 0 (exact)"
            )
        ax.plot(ranks, [bound[name][p] for p in ranks], "--", color=f"C{i}", label=f"{name}, bound P u / (1 - P u)")
    ax.set_yscale("log")
    ax.set_xticks(sorted({p for per in measured.values() for p in per}))
    ax.set_xlabel("ranks P adding into each element")
    ax.set_ylabel("max |error| / sum |x_i|")
    ax.set_title("A ring reduce-scatter rounded at every hop")
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return describe(fig, alt)

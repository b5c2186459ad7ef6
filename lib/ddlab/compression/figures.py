"""Lab 11's figures: bytes sent against the loss reached, and the hierarchical allreduce against the flat ring."""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..plots import size_axis
from ..plots.alt import describe, subplots
from ..plots.helpers import finish_panels
from .experiment import TrainingRun

MARKERS = {"dense": "*", "topk": "o", "randomk": "s", "qsgd8": "^", "sign": "D"}


def bytes_and_loss(runs: Sequence[TrainingRun], steps: int, *, alt: str) -> plt.Figure:
    """Left: test loss against bytes per step over the dense ring's; right: time per step over the dense ring's.

    Filled markers are runs with error feedback, hollow ones without.
    """
    dense = next(r for r in runs if r.method == "dense")
    fig, (left, right) = subplots(1, 2, figsize=(10, 3.8))
    for i, run in enumerate(runs):
        label = (
            run.method
            if run.method == "dense"
            else f"{run.method} {run.density:.0%} {'EF' if run.feedback else 'no EF'}"
        )
        style = dict(
            marker=MARKERS[run.method], s=70, color=f"C{i}", label=label, facecolors=f"C{i}" if run.feedback else "none"
        )
        left.scatter(run.bytes_per_step / dense.bytes_per_step, run.loss, **style)
        right.scatter(run.bytes_per_step / dense.bytes_per_step, run.seconds_per_step / dense.seconds_per_step, **style)
    left.axhline(dense.loss * 1.1, color="grey", linestyle=":", label="dense loss + 10%")
    right.axhline(1, color="grey", linestyle=":", label="dense ring's time")
    left.set_ylabel(f"test mean squared error after {steps} steps")
    right.set_ylabel("seconds per step / dense ring's")
    for ax in (left, right):
        ax.set_xscale("log")
    finish_panels(fig, (left, right), "bytes sent per step / dense ring's", "Compressed gradients on lab 04's MLP")
    right.get_legend().remove()
    return describe(fig, alt)


def hierarchical_vs_flat(
    sizes: Sequence[float],
    measured: dict[str, Sequence[float]],
    predicted: dict[str, Sequence[float]],
    title: str,
    *,
    alt: str,
) -> plt.Figure:
    """Seconds per allreduce against bytes, measured (solid) and predicted (dotted), one colour per method."""
    fig, ax = subplots(figsize=(6.5, 3.8))
    for i, name in enumerate(measured):
        ax.loglog(sizes, np.asarray(measured[name]), "o-", color=f"C{i}", label=f"{name}, measured")
        ax.loglog(sizes, np.asarray(predicted[name]), ":", color=f"C{i}", label=f"{name}, model")
    ax.set_ylabel("seconds per allreduce")
    ax.set_title(title, fontsize=10)
    size_axis(ax, sizes, "vector size")
    fig.tight_layout()
    return describe(fig, alt)

"""Lab 05's figures: scaling curves, time breakdowns, batch size and learning curves, fusion costs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from ..plots.alt import describe, subplots
from ..plots.helpers import byte_label, finish_panels
from ..plots.timelines import COLOURS


def scaling_curves(
    ranks: Sequence[int],
    strong: Sequence[float],
    weak: Sequence[float] | None = None,
    title: str = "",
    *,
    alt: str,
) -> plt.Figure:
    """Speedup and efficiency from times per step (strong: fixed global work; weak: fixed work per rank)."""
    p, strong_t = np.asarray(ranks, dtype=float), np.asarray(strong, dtype=float)
    fig, (left, right) = subplots(1, 2, figsize=(10, 3.6))
    left.plot(p, p, "k--", lw=1, label="ideal: speedup = P")
    left.plot(p, strong_t[0] / strong_t, "o-", label="strong scaling: T(1) / T(P)")
    left.set_ylabel("speedup")
    right.axhline(1.0, color="black", ls="--", lw=1, label="ideal")
    right.plot(p, strong_t[0] / (p * strong_t), "o-", label="strong: T(1) / (P T(P))")
    if weak is not None:
        weak_t = np.asarray(weak, dtype=float)
        right.plot(p, weak_t[0] / weak_t, "s-", label="weak: T(1) / T(P)")
    right.set_ylabel("efficiency")
    right.set_ylim(0, 1.15)
    for ax in (left, right):
        ax.set_xticks(p, [str(int(v)) for v in p])
    return describe(finish_panels(fig, (left, right), "ranks P", title), alt)


def time_breakdown(
    rows: Sequence[dict[str, float]],
    labels: Sequence[str],
    title: str = "",
    unit: float = 1e3,
    unit_name: str = "ms",
    *,
    alt: str,
) -> plt.Figure:
    """Stacked bars: one bar per row (a rank, a run), one segment per phase."""
    phases = list(dict.fromkeys(k for row in rows for k in row))
    fig, ax = subplots(figsize=(max(5.0, 0.9 * len(rows) + 3), 3.6))
    bottom = np.zeros(len(rows))
    for phase in phases:
        values = np.array([row.get(phase, 0.0) for row in rows]) * unit
        ax.bar(range(len(rows)), values, 0.6, bottom=bottom, label=phase, color=COLOURS.get(phase))
        bottom += values
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel(f"time per step ({unit_name})")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return describe(fig, alt)


def batch_size_tradeoff(
    batch_sizes: Sequence[int],
    epoch_times: Sequence[float],
    scores: Sequence[float],
    title: str = "",
    *,
    alt: str,
) -> plt.Figure:
    """Larger batches: shorter epochs (left), but fewer updates, so less learnt per epoch (right)."""
    b = np.asarray(batch_sizes, dtype=float)
    fig, (left, right) = subplots(1, 2, figsize=(10, 3.4))
    left.plot(b, epoch_times, "o-")
    left.set_ylabel("seconds per epoch")
    right.plot(b, scores, "o-", color="tab:green")
    right.set_ylabel("R^2 on held-out tests")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(b, [str(int(v)) for v in b])
        ax.minorticks_off()
        ax.set_xlabel("global batch size")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return describe(fig, alt)


def learning_curves(
    curves: dict[str, Sequence[float]], xlabel: str, ylabel: str, title: str = "", *, alt: str
) -> plt.Figure:
    """One line per label (e.g. R^2 after each epoch, per learning-rate rule)."""
    fig, ax = subplots(figsize=(6.5, 3.6))
    for label, values in curves.items():
        ax.plot(np.arange(1, len(values) + 1), values, "o-", ms=4, label=label)
    ax.set_xticks(np.arange(1, max(map(len, curves.values()), default=0) + 1))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return describe(fig, alt)


def fusion_costs(
    pieces: Sequence[int],
    measured: Sequence[float],
    alpha: float,
    beta: float,
    nbytes: float,
    marks: dict[str, int] | None = None,
    *,
    alt: str,
) -> plt.Figure:
    """k allreduces of n/k bytes against one of n: measured ratio and (k alpha + n beta)/(alpha + n beta)."""
    k = np.asarray(pieces, dtype=float)
    fine = np.geomspace(k.min(), k.max(), 200)
    fig, ax = subplots(figsize=(6.5, 3.6))
    ax.plot(
        fine,
        (fine * alpha + nbytes * beta) / (alpha + nbytes * beta),
        "k--",
        lw=1,
        label="model (k alpha + n beta) / (alpha + n beta)",
    )
    ax.plot(k, measured, "o", label="measured T(k pieces) / T(1 piece)")
    for name, value in (marks or {}).items():
        ax.axvline(value, color="gray", ls=":", lw=1)
        ax.text(value, ax.get_ylim()[1], f" {name}", rotation=90, va="top", fontsize=7, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_xticks(k, [str(int(v)) for v in k])
    ax.minorticks_off()
    ax.set_xlabel(f"allreduces k for the same {byte_label(nbytes)}")
    ax.set_ylabel("time relative to one fused allreduce")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return describe(fig, alt)


def score_against_time(
    runs: dict[str, tuple[Sequence[float], Sequence[float]]],
    target: float | None = None,
    title: str = "",
    *,
    alt: str,
) -> plt.Figure:
    """Held-out score against training wall-clock, one line per run (label: (times, scores)); a target as a line.

    Labels ending in "1 rank" are dashed, in the colour of the same setting on more ranks.
    """
    fig, ax = subplots(figsize=(7.5, 3.8))
    colours: dict[str, Any] = {}
    for label, (times, scores) in runs.items():
        setting, _, ranks = label.rpartition(", ")
        (line,) = ax.plot(
            times,
            scores,
            "--" if ranks == "1 rank" else "-",
            marker="o",
            ms=3,
            lw=1.3,
            color=colours.get(setting),
            label=label,
        )
        colours.setdefault(setting, line.get_color())
    if target is not None:
        ax.axhline(target, color="black", lw=0.8, ls=":", label=f"target {target:g}")
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("R^2 on held-out tests")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return describe(fig, alt)

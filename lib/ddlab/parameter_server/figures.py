"""Lab 10's figures: server against allreduce as workers are added, loss per mode, staleness and divergence."""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..plots.alt import describe, subplots
from ..plots.helpers import finish_panels
from .replay import Comparison
from .run import Record


def cost_against_workers(
    workers: Sequence[int],
    measured: dict[str, Sequence[float]],
    predicted: dict[str, Sequence[float]],
    title: str,
    *,
    alt: str,
) -> plt.Figure:
    """Milliseconds per step against the number of workers P: measured (left) and modelled (right), per method."""
    fig, (left, right) = subplots(1, 2, figsize=(10, 3.6))
    for i, name in enumerate(measured):
        left.plot(workers, 1e3 * np.asarray(measured[name]), "o-", color=f"C{i}", label=f"{name}, measured")
        right.plot(workers, 1e3 * np.asarray(predicted[name]), "o:", color=f"C{i}", label=f"{name}, model")
    for ax in (left, right):
        ax.set_xticks(list(workers))
        ax.set_ylim(bottom=0)
    left.set_ylabel("ms per step")
    right.set_ylabel("ms per step, transfers only")
    return describe(finish_panels(fig, (left, right), "workers P", title), alt)


def loss_per_mode(runs: dict[float, Sequence[Record]], *, alt: str) -> plt.Figure:
    """Loss against wall-clock (left) and against steps (right), one row per straggler factor, one line per mode."""
    fig, axes = subplots(len(runs), 2, figsize=(10, 3.2 * len(runs)), squeeze=False)
    for row, (factor, records) in zip(axes, runs.items()):
        for i, record in enumerate(records):
            seconds, steps, loss = np.array(record.curve).T
            row[0].semilogy(seconds, loss, color=f"C{i}", label=record.mode)
            row[1].semilogy(steps, loss, color=f"C{i}", label=record.mode)
        straggler = "no straggler" if factor == 1 else f"one worker {factor:g}x slower"
        row[0].set_title(f"{straggler}: loss against wall-clock", fontsize=9)
        row[1].set_title(f"{straggler}: loss against steps", fontsize=9)
        row[0].set_xlabel("seconds")
        row[1].set_xlabel("steps (updates / workers for async and ssp)")
        for ax in row:
            ax.set_ylabel("loss")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    fig.tight_layout()
    return describe(fig, alt)


def staleness_and_divergence(
    staleness: dict[str, Sequence[int]],
    divergence: Sequence[float],
    title: str,
    *,
    alt: str,
) -> plt.Figure:
    """Left: how many updates were applied between a gradient's pull and its push, per mode; right: gossip's spread."""
    fig, (left, right) = subplots(1, 2, figsize=(10, 3.6))
    most = max((max(values, default=0) for values in staleness.values()), default=0)
    edges = np.arange(most + 2) - 0.5
    for i, (mode, values) in enumerate(staleness.items()):
        left.hist(
            values,
            bins=edges,
            histtype="step",
            lw=1.5,
            color=f"C{i}",
            density=True,
            label=f"{mode}: mean {np.mean(values):.1f}, max {max(values, default=0)}",
        )
    left.set_ylabel("fraction of updates")
    left.set_xlabel("staleness (updates applied since the gradient's parameters)")
    right.plot(np.arange(len(divergence)), divergence, color="C3", label="max over ranks of |w_r - mean|")
    right.set_ylabel("parameter distance")
    finish_panels(fig, (right,), "step", title)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    return describe(fig, alt)


def straggler_kinds(comparison: Comparison, *, alt: str) -> plt.Figure:
    """Per staleness bound s (inf: asynchronous): time to a fixed number of updates (left), loss after them (right).

    One line per kind of straggler (steady, transient), each point a mean over seeds."""
    fig, (left, right) = subplots(1, 2, figsize=(10, 3.4))
    where = np.arange(len(comparison.bounds))
    for i, kind in enumerate(comparison.time):
        left.plot(where, comparison.time[kind], "o-", color=f"C{i}", label=f"{kind} straggler")
        right.plot(where, comparison.loss[kind], "o-", color=f"C{i}", label=f"{kind} straggler")
    right.axhline(comparison.best, color="gray", ls=":", label="lowest possible")
    names = ["async" if np.isinf(s) else f"s = {s:g}" for s in comparison.bounds]
    for ax in (left, right):
        ax.set_xticks(where, names)
        ax.set_xlabel("staleness bound (s = 0: BSP)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylim(bottom=0)
    left.set_ylabel("time to the updates (1 = a normal step)")
    right.set_ylabel("loss after the updates")
    fig.tight_layout()
    return describe(fig, alt)

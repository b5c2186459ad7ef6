"""Lab 03's figures: the ring's steps, exchange patterns, measured sweeps against the model, bytes against the lower bound."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch

from ..plots.alt import describe, subplots
from ..plots.helpers import arrow, rank_colour, size_axis
from .algorithms import largest_power_of_two, member_rank
from .cost import bus_bandwidth


def _contribution_cell(ax: plt.Axes, x: float, y: float, sources: set[int], p: int, edge: str, lw: float) -> None:
    """One chunk of one rank: a stripe in the colour of every rank whose data it holds."""
    stripe = 0.9 / p
    for source in sorted(sources):
        ax.add_patch(
            plt.Rectangle(
                (x - 0.45 + source * stripe, y - 0.4), stripe, 0.8, fc=rank_colour(source), ec="none", alpha=0.75
            )
        )
    ax.add_patch(plt.Rectangle((x - 0.45, y - 0.4), 0.9, 0.8, fc="none", ec=edge, lw=lw))


def _relative(offset: int) -> str:
    """'r', 'r+1', 'r-2': a chunk or rank number relative to rank r."""
    return "r" if offset == 0 else f"r{offset:+d}"


def ring_allreduce_steps(p: int = 4, *, alt: str) -> plt.Figure:
    """The ring allreduce step by step: rows are ranks, columns chunks, stripes whose data a chunk holds.

    Reduce-scatter step s: rank r sends chunk r-s to rank r+1, which adds it to its own.
    Allgather step s: rank r sends its complete chunk r+1-s on to rank r+1, which keeps it.
    Red outlines mark the chunks that just arrived; thick black ones the complete sums.
    """
    held = [[{r} for _ in range(p)] for r in range(p)]
    stages: list[tuple[str, list[list[set[int]]], set[tuple[int, int]]]] = [
        ("start: each rank's own vector, in P chunks", held, set())
    ]
    for phase, first, verb in (("reduce-scatter", 0, "adds it"), ("allgather", 1, "keeps it")):
        for step in range(p - 1):
            new = [[set(cell) for cell in row] for row in held]
            for r in range(p):
                c = (r + first - step) % p
                new[(r + 1) % p][c] = held[r][c] | (new[(r + 1) % p][c] if first == 0 else set())
            arrived = {((r + 1) % p, (r + first - step) % p) for r in range(p)}
            stages.append(
                (
                    f"{phase} {step + 1}/{p - 1}: r sends chunk {_relative(first - step)}\nto r+1, which {verb}",
                    new,
                    arrived,
                )
            )
            held = new
    rows = -(-len(stages) // p)
    fig, axes = subplots(rows, p, figsize=(2.6 * p, 2.5 * rows), squeeze=False)
    for ax, (title, state, arrived) in zip(axes.flat, stages):
        for r in range(p):
            for c in range(p):
                full = len(state[r][c]) == p
                edge, lw = ("tab:red", 2.2) if (r, c) in arrived else ("black", 2.0 if full else 0.6)
                _contribution_cell(ax, c, p - 1 - r, state[r][c], p, edge, lw)
        ax.set_xlim(-0.6, p - 0.4)
        ax.set_ylim(-0.6, p - 0.4)
        ax.set_xticks(range(p), [f"c{c}" for c in range(p)], fontsize=7)
        ax.set_yticks(range(p), [f"rank {r}" for r in reversed(range(p))], fontsize=7)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(title, fontsize=8)
    for ax in list(axes.flat)[len(stages) :]:
        ax.axis("off")
    fig.suptitle(
        f"Ring allreduce on {p} ranks: the stripes of a chunk are the ranks whose data it holds "
        "(red: just arrived; thick black: the complete sum)",
        fontsize=9,
    )
    fig.tight_layout()
    return describe(fig, alt)


def exchange_pattern(p: int = 6, algorithm: str = "recursive_doubling", *, alt: str) -> plt.Figure:
    """Who exchanges with whom, step by step, in recursive doubling or Rabenseifner's algorithm.

    With P not a power of two, the first 2r ranks (r = P - p') fold in first (even rank
    sends to odd) and out at the end; the even ones sit out in between (grey). Labels
    give the items each message carries, for n items in all.
    """

    pof2 = largest_power_of_two(p)
    extra, steps = p - pof2, pof2.bit_length() - 1
    if algorithm == "recursive_doubling":
        core = [(1 << k, "n") for k in range(steps)]
    elif algorithm == "rabenseifner":
        halving = [(pof2 >> (k + 1), f"n/{2 ** (k + 1)}") for k in range(steps)]
        core = halving + [(d, size) for d, size in reversed(halving)]
    else:
        raise ValueError(f"algorithm must be 'recursive_doubling' or 'rabenseifner', got {algorithm!r}")
    columns = (
        ([("fold in", None, "n")] if extra else [])
        + [(f"step {i + 1}\ndistance {d}", d, size) for i, (d, size) in enumerate(core)]
        + ([("fold out", None, "n")] if extra else [])
    )
    fig, ax = subplots(figsize=(1.25 * len(columns) + 1.5, 0.45 * p + 1.3))
    out = {2 * i for i in range(extra)}
    for x, (label, distance, size) in enumerate(columns):
        if distance is None:  # the fold: one-way arrows between ranks 2i and 2i+1
            for i in range(extra):
                start, end = (2 * i, 2 * i + 1) if x == 0 else (2 * i + 1, 2 * i)
                arrow(ax, (x, -start), (x, -end), color="tab:blue", lw=1.5)
        else:
            for member in range(pof2):
                partner = member ^ distance
                if member < partner:
                    a, b = member_rank(member, p), member_rank(partner, p)
                    shift = 0.35 * ((member % distance) / max(distance, 1) - 0.4)
                    ax.add_patch(
                        FancyArrowPatch(
                            (x + shift, -a),
                            (x + shift, -b),
                            arrowstyle="<|-|>",
                            mutation_scale=8,
                            color="tab:red",
                            lw=1.2,
                        )
                    )
        ax.text(x, -p + 0.2, f"{label}\n{size} items", ha="center", va="top", fontsize=8)
        for r in range(p):
            sitting_out = r in out and 0 < x < len(columns) - 1 if extra else False
            ax.plot(x, -r, "o", ms=6, color="lightgray" if sitting_out else rank_colour(r), zorder=3)
    ax.set_yticks([-r for r in range(p)], [f"rank {r}" for r in range(p)], fontsize=8)
    ax.set_xticks([])
    ax.set_xlim(-0.6, len(columns) - 0.4)
    ax.set_ylim(-p - 0.9, 0.6)
    for side in ax.spines.values():
        side.set_visible(False)
    name = "Recursive doubling" if algorithm == "recursive_doubling" else "Rabenseifner (halving, then doubling)"
    ax.set_title(f"{name} on {p} ranks" + (f" (p' = {pof2}; grey ranks sit out)" if extra else ""), fontsize=10)
    fig.tight_layout()
    return describe(fig, alt)


def allreduce_sweep(
    nbytes: Sequence[float],
    measured: dict[str, Sequence[float]],
    size: int,
    predicted: dict[str, Sequence[float]] | None = None,
    memcpy_bandwidth: float | None = None,
    *,
    alt: str,
) -> plt.Figure:
    """Allreduce time against size (measured dots, predicted dashes) and bus bandwidth against memcpy's."""

    n = np.asarray(nbytes, dtype=float)
    fig, (left, right) = subplots(1, 2, figsize=(11, 4))
    for i, (name, seconds) in enumerate(measured.items()):
        colour = plt.get_cmap("tab10")(i)
        left.loglog(n, np.asarray(seconds) * 1e6, "o-", ms=4, color=colour, label=name)
        if predicted and name in predicted:
            left.loglog(n, np.asarray(predicted[name]) * 1e6, "--", lw=1, color=colour)
        right.semilogx(n, bus_bandwidth(n, np.asarray(seconds), size) / 1e9, "o-", ms=4, color=colour, label=name)
    if predicted:
        left.plot([], [], "k--", lw=1, label="model (dashed)")
    if memcpy_bandwidth:
        right.axhline(memcpy_bandwidth / 1e9, color="gray", ls="--", label="memcpy, one rank")
    for ax in (left, right):
        size_axis(ax, n, "vector size", every=2, legend_size=7)
    left.set_ylabel("time (microseconds)")
    left.set_title(f"Allreduce on {size} ranks", fontsize=10)
    right.set_ylabel("bus bandwidth (GB/s)")
    right.set_title("Bus bandwidth = n / T * 2(P-1)/P", fontsize=10)
    fig.tight_layout()
    return describe(fig, alt)


def bytes_against_lower_bound(sent: dict[str, float], lower_bound: float, title: str = "", *, alt: str) -> plt.Figure:
    """Bytes the busiest rank sent, per algorithm, against the lower bound 2(P-1)/P n."""
    fig, ax = subplots(figsize=(6.5, 3.2))
    names = list(sent)
    ax.bar(range(len(names)), [sent[k] for k in names], color=[plt.get_cmap("tab10")(i) for i in range(len(names))])
    ax.axhline(lower_bound, color="black", ls="--", lw=1, label="lower bound 2(P-1)/P n")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("bytes sent by the busiest rank")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return describe(fig, alt)


def call_parts(microseconds: dict[str, float], baseline: str, title: str = "", *, alt: str) -> plt.Figure:
    """What each part of a small allreduce call costs (horizontal bars, in us), the baseline's time dashed."""
    names = list(microseconds)[::-1]
    fig, ax = subplots(figsize=(7.5, 0.35 * len(names) + 1.2))
    colours = ["black" if name == baseline else plt.get_cmap("tab10")(i) for i, name in enumerate(names)]
    ax.barh(range(len(names)), [microseconds[k] for k in names], color=colours)
    ax.axvline(microseconds[baseline], color="black", ls="--", lw=1)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel("microseconds per call (median, slowest rank)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return describe(fig, alt)

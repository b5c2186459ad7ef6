"""Figures for the labs: cluster layout, data movement, curves, schedules."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch


def _box(ax: plt.Axes, x: float, y: float, w: float, h: float, text: str, color: str) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="black"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)


def _arrow(ax: plt.Axes, start: tuple[float, float], end: tuple[float, float], **style: object) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10, **style))


def cluster_diagram(n_engines: int = 4) -> plt.Figure:
    """Notebook -> controller -> engines, with the MPI messages between engines."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 1.2 * n_engines
    _box(ax, width / 2 - 0.7, 2.4, 1.4, 0.5, "notebook\n(kernel)", "#e8f0fe")
    _box(ax, width / 2 - 0.7, 1.4, 1.4, 0.5, "controller", "#fde9d9")
    _arrow(ax, (width / 2, 2.4), (width / 2, 1.9))
    for rank in range(n_engines):
        x = rank * 1.2 + 0.1
        _box(ax, x, 0.2, 1.0, 0.55, f"engine {rank}\nMPI rank {rank}", "#e6f4ea")
        _arrow(ax, (width / 2, 1.4), (x + 0.5, 0.75), color="gray")
        if rank + 1 < n_engines:
            _arrow(ax, (x + 1.0, 0.35), (x + 1.2, 0.35), color="tab:red")
    ax.text(width - 0.1, 0.05, "red: MPI messages between ranks", ha="right", fontsize=8, color="tab:red")
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(0, 3.0)
    ax.axis("off")
    ax.set_title(f"One MPI job of {n_engines} engines, driven from this notebook", fontsize=10)
    return fig


def _byte_label(n: float) -> str:
    """8 B, 64 KiB, 16 MiB: a power-of-two byte count for an axis tick."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:g} B"


def _size_axis(ax: plt.Axes, sizes: Sequence[float], label: str, every: int = 3, legend_size: int = 8) -> None:
    """A log x-axis of byte sizes: power-of-two ticks named in B/KiB/MiB, a grid, the legend."""
    ticks = [2**k for k in range(0, 40, every) if min(sizes) <= 2**k <= max(sizes)]
    ax.set_xticks(ticks, [_byte_label(k) for k in ticks], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel(label)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=legend_size)


def latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float], alpha: float, beta: float) -> plt.Figure:
    """Ping-pong times against the model T(n) = alpha + beta*n (log-log), and bandwidth n/T(n)."""
    n, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    dense = np.geomspace(max(n.min(), 1), n.max(), 200)
    model = alpha + beta * dense
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.loglog(n, t * 1e6, "o", ms=4, label="measured (ping-pong)")
    left.loglog(dense, model * 1e6, "-", label=f"model: alpha = {alpha * 1e6:.3g} us, 1/beta = {1 / beta / 1e9:.3g} GB/s")
    left.set_ylabel("one-way time (microseconds)")
    left.set_title("Time per message: alpha + beta * n", fontsize=10)
    right.semilogx(n, n / t / 1e9, "o", ms=4, label="measured n / T(n)")
    right.semilogx(dense, dense / model / 1e9, "-", label="model n / (alpha + beta n)")
    right.axhline(1 / beta / 1e9, color="gray", ls="--", lw=1, label="1 / beta (the asymptote)")
    half = alpha / beta
    if n.min() <= half <= n.max():
        right.axvline(half, color="gray", ls=":", lw=1, label=f"n_1/2 = alpha / beta = {_byte_label(half)}")
    right.set_ylabel("bandwidth (GB/s)")
    right.set_title("Bandwidth: half of the peak at n_1/2", fontsize=10)
    for ax in (left, right):
        _size_axis(ax, n, "message size")
    fig.tight_layout()
    return fig


def _rank_colour(rank: int) -> tuple[float, float, float, float]:
    return plt.get_cmap("tab10")(rank % 10)


def _draw_ranks(ax: plt.Axes, arrays: Sequence[np.ndarray | None], width: int, combined: bool) -> None:
    """One row per rank, one cell per element; colour = the rank the value came from."""
    for rank, array in enumerate(arrays):
        y = len(arrays) - 1 - rank
        if array is None:
            ax.text(-0.4, y, "None", va="center", fontsize=9, style="italic", color="gray")
            continue
        for i, value in enumerate(np.ravel(array)):
            if value < 0:  # a slot not filled yet
                ax.add_patch(plt.Rectangle((i - 0.45, y - 0.4), 0.9, 0.8, fc="white", ec="gray", ls="--"))
                continue
            if combined:  # a sum over all ranks: a stripe of every rank's colour
                stripe = 0.9 / len(arrays)
                for source in range(len(arrays)):
                    ax.add_patch(plt.Rectangle((i - 0.45 + source * stripe, y - 0.4), stripe, 0.8,
                                               fc=_rank_colour(source), ec="none", alpha=0.6))
                ax.add_patch(plt.Rectangle((i - 0.45, y - 0.4), 0.9, 0.8, fc="none", ec="black"))
            else:
                origin = int(value) // 10
                colour = _rank_colour(origin) if origin < len(arrays) else "lightgray"
                ax.add_patch(plt.Rectangle((i - 0.45, y - 0.4), 0.9, 0.8, fc=colour, ec="black", alpha=0.85))
            ax.text(i, y, f"{value:g}", ha="center", va="center", fontsize=8,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"} if combined else None)
    ax.set_xlim(-0.6, max(width, 1) - 0.4)
    ax.set_ylim(-0.6, len(arrays) - 0.4)
    ax.set_yticks(range(len(arrays)), [f"rank {r}" for r in reversed(range(len(arrays)))])
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)


def data_movement(before: Sequence[np.ndarray | None], after: Sequence[np.ndarray | None], title: str,
                  combined: bool = False) -> plt.Figure:
    """Every rank's array before and after a collective, side by side.

    Values are read as labels 10 * rank + index, so each cell takes the colour of the
    rank the value started on. Negative values are slots not filled yet (dashed);
    None is a rank that holds nothing. With `combined`, the values after are sums
    over ranks (reduce, allreduce) and are drawn striped in every rank's colour.
    """
    widths = [max([np.size(a) for a in arrays if a is not None], default=1) for arrays in (before, after)]
    fig, axes = plt.subplots(1, 2, figsize=(2.5 + 0.55 * sum(widths), 0.9 + 0.45 * len(before)),
                             gridspec_kw={"width_ratios": [max(w, 2) for w in widths]})
    for ax, arrays, width, label in zip(axes, (before, after), widths, ("before", "after")):
        _draw_ranks(ax, arrays, width, combined and label == "after")
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def time_vs_size(nbytes: Sequence[float], panels: dict[str, dict[str, Sequence[float]]]) -> plt.Figure:
    """Time against message size (log-log), one panel per title, one line per algorithm."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items()):
        for label, seconds in lines.items():
            ax.loglog(nbytes, np.asarray(seconds) * 1e6, "o-", ms=4, label=label)
        _size_axis(ax, nbytes, "array size")
        ax.set_ylabel("time (microseconds)")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


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


def memory_fit(sides: Sequence[int], peaks: dict[str, Sequence[Sequence[float] | None]], budget: float,
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


_PIPELINE_COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "send": "#dd8452", "recv": "#8172b3",
                 "idle": "#eeeeee", "other": "#bbbbbb"}


def pipeline_gantt(spans_by_rank: Sequence[Sequence[object]], title: str = "", ax: plt.Axes | None = None,
          unit: float = 1e3, unit_name: str = "ms") -> plt.Figure:
    """One row per rank, one bar per span ('forward 3' ...), coloured by kind, numbered by micro-batch.

    spans_by_rank: per rank, objects with name, start and end (ddlab.trace.Span).
    """
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.55 * len(spans_by_rank) + 1.3))
    else:
        fig = ax.figure
    end = max((s.end for spans in spans_by_rank for s in spans), default=1.0) * unit
    for rank, spans in enumerate(spans_by_rank):
        for span in spans:
            kind, mb = span.name, span.number
            width = (span.end - span.start) * unit
            ax.barh(rank, width, left=span.start * unit, height=0.7, color=_PIPELINE_COLOURS.get(kind, "#999999"),
                    edgecolor="white" if kind in ("forward", "backward") else "none", linewidth=0.5)
            if kind in ("forward", "backward") and mb is not None and width > end / 90:
                ax.text(span.start * unit + width / 2, rank, str(mb), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(spans_by_rank)), [f"rank {r}" for r in range(len(spans_by_rank))])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(f"time ({unit_name})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=_PIPELINE_COLOURS[k]) for k in ("forward", "backward", "send", "recv", "idle")]
    ax.legend(handles, ["forward", "backward", "send", "recv", "idle"], fontsize=7, ncol=5, loc="upper center",
              bbox_to_anchor=(0.5, -0.32 if len(spans_by_rank) < 4 else -0.22), frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def pipeline_gantt_pair(top: Sequence[Sequence[object]], bottom: Sequence[Sequence[object]], titles: tuple[str, str]) -> plt.Figure:
    """Two Gantt charts one above the other (e.g. the busy clock and the wall clock of one run)."""
    ranks = len(top)
    fig, axes = plt.subplots(2, 1, figsize=(10, 1.1 * ranks + 2.6))
    pipeline_gantt(top, titles[0], ax=axes[0])
    pipeline_gantt(bottom, titles[1], ax=axes[1])
    fig.tight_layout()
    return fig


def bubble_vs_theory(micro_batches: Sequence[int], measured: dict[str, Sequence[float]], stages: int) -> plt.Figure:
    """Measured bubble fraction against micro-batches, with the theory (K-1)/(M+K-1)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
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


# Lab 03: allreduce ---------------------------------------------------------------

def _contribution_cell(ax: plt.Axes, x: float, y: float, sources: set[int], p: int, edge: str, lw: float) -> None:
    """One chunk of one rank: a stripe in the colour of every rank whose data it holds."""
    stripe = 0.9 / p
    for source in sorted(sources):
        ax.add_patch(plt.Rectangle((x - 0.45 + source * stripe, y - 0.4), stripe, 0.8,
                                   fc=_rank_colour(source), ec="none", alpha=0.75))
    ax.add_patch(plt.Rectangle((x - 0.45, y - 0.4), 0.9, 0.8, fc="none", ec=edge, lw=lw))


def _relative(offset: int) -> str:
    """'r', 'r+1', 'r-2': a chunk or rank number relative to rank r."""
    return "r" if offset == 0 else f"r{offset:+d}"


def ring_allreduce_steps(p: int = 4) -> plt.Figure:
    """The ring allreduce step by step: rows are ranks, columns chunks, stripes whose data a chunk holds.

    Reduce-scatter step s: rank r sends chunk r-s to rank r+1, which adds it to its own.
    Allgather step s: rank r sends its complete chunk r+1-s on to rank r+1, which keeps it.
    Red outlines mark the chunks that just arrived; thick black ones the complete sums.
    """
    held = [[{r} for _ in range(p)] for r in range(p)]
    stages = [("start: each rank's own vector, in P chunks", held, set())]
    for phase, first, verb in (("reduce-scatter", 0, "adds it"), ("allgather", 1, "keeps it")):
        for step in range(p - 1):
            new = [[set(cell) for cell in row] for row in held]
            for r in range(p):
                c = (r + first - step) % p
                new[(r + 1) % p][c] = held[r][c] | (new[(r + 1) % p][c] if first == 0 else set())
            arrived = {((r + 1) % p, (r + first - step) % p) for r in range(p)}
            stages.append((f"{phase} {step + 1}/{p - 1}: r sends chunk {_relative(first - step)}\n"
                           f"to r+1, which {verb}", new, arrived))
            held = new
    rows = -(-len(stages) // p)
    fig, axes = plt.subplots(rows, p, figsize=(2.6 * p, 2.5 * rows), squeeze=False)
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
    for ax in list(axes.flat)[len(stages):]:
        ax.axis("off")
    fig.suptitle(f"Ring allreduce on {p} ranks: the stripes of a chunk are the ranks whose data it holds "
                 "(red: just arrived; thick black: the complete sum)", fontsize=9)
    fig.tight_layout()
    return fig


def exchange_pattern(p: int = 6, algorithm: str = "recursive_doubling") -> plt.Figure:
    """Who exchanges with whom, step by step, in recursive doubling or Rabenseifner's algorithm.

    With P not a power of two, the first 2r ranks (r = P - p') fold in first (even rank
    sends to odd) and out at the end; the even ones sit out in between (grey). Labels
    give the items each message carries, for n items in all.
    """
    from .allreduce import largest_power_of_two, member_rank

    pof2 = largest_power_of_two(p)
    extra, steps = p - pof2, pof2.bit_length() - 1
    if algorithm == "recursive_doubling":
        core = [(1 << k, "n") for k in range(steps)]
    elif algorithm == "rabenseifner":
        halving = [(pof2 >> (k + 1), f"n/{2 ** (k + 1)}") for k in range(steps)]
        core = halving + [(d, size) for d, size in reversed(halving)]
    else:
        raise ValueError(f"algorithm must be 'recursive_doubling' or 'rabenseifner', got {algorithm!r}")
    columns = ([("fold in", None, "n")] if extra else []) + [
        (f"step {i + 1}\ndistance {d}", d, size) for i, (d, size) in enumerate(core)
    ] + ([("fold out", None, "n")] if extra else [])
    fig, ax = plt.subplots(figsize=(1.25 * len(columns) + 1.5, 0.45 * p + 1.3))
    out = {2 * i for i in range(extra)}
    for x, (label, distance, size) in enumerate(columns):
        if distance is None:  # the fold: one-way arrows between ranks 2i and 2i+1
            for i in range(extra):
                start, end = (2 * i, 2 * i + 1) if x == 0 else (2 * i + 1, 2 * i)
                _arrow(ax, (x, -start), (x, -end), color="tab:blue", lw=1.5)
        else:
            for member in range(pof2):
                partner = member ^ distance
                if member < partner:
                    a, b = member_rank(member, p), member_rank(partner, p)
                    shift = 0.35 * ((member % distance) / max(distance, 1) - 0.4)
                    ax.add_patch(FancyArrowPatch((x + shift, -a), (x + shift, -b), arrowstyle="<|-|>",
                                                 mutation_scale=8, color="tab:red", lw=1.2))
        ax.text(x, -p + 0.2, f"{label}\n{size} items", ha="center", va="top", fontsize=8)
        for r in range(p):
            sitting_out = r in out and 0 < x < len(columns) - 1 if extra else False
            ax.plot(x, -r, "o", ms=6, color="lightgray" if sitting_out else _rank_colour(r), zorder=3)
    ax.set_yticks([-r for r in range(p)], [f"rank {r}" for r in range(p)], fontsize=8)
    ax.set_xticks([])
    ax.set_xlim(-0.6, len(columns) - 0.4)
    ax.set_ylim(-p - 0.9, 0.6)
    for side in ax.spines.values():
        side.set_visible(False)
    name = "Recursive doubling" if algorithm == "recursive_doubling" else "Rabenseifner (halving, then doubling)"
    ax.set_title(f"{name} on {p} ranks" + (f" (p' = {pof2}; grey ranks sit out)" if extra else ""), fontsize=10)
    fig.tight_layout()
    return fig


def allreduce_sweep(nbytes: Sequence[float], measured: dict[str, Sequence[float]], size: int,
                    predicted: dict[str, Sequence[float]] | None = None,
                    memcpy_bandwidth: float | None = None) -> plt.Figure:
    """Allreduce time against size (measured dots, predicted dashes) and bus bandwidth against memcpy's."""
    from .costmodel import bus_bandwidth

    n = np.asarray(nbytes, dtype=float)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
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
        _size_axis(ax, n, "vector size", every=2, legend_size=7)
    left.set_ylabel("time (microseconds)")
    left.set_title(f"Allreduce on {size} ranks", fontsize=10)
    right.set_ylabel("bus bandwidth (GB/s)")
    right.set_title("Bus bandwidth = n / T * 2(P-1)/P", fontsize=10)
    fig.tight_layout()
    return fig


def bytes_against_lower_bound(sent: dict[str, float], lower_bound: float, title: str = "") -> plt.Figure:
    """Bytes the busiest rank sent, per algorithm, against the lower bound 2(P-1)/P n."""
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    names = list(sent)
    ax.bar(range(len(names)), [sent[k] for k in names], color=[plt.get_cmap("tab10")(i) for i in range(len(names))])
    ax.axhline(lower_bound, color="black", ls="--", lw=1, label="lower bound 2(P-1)/P n")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("bytes sent by the busiest rank")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


# Data parallelism and scaling (labs 04-05) -----------------------------------------

_PHASE_COLOURS = {"data": "#8c8c8c", "forward": "#4c72b0", "backward": "#55a868", "allreduce": "#c44e52",
                  "optimizer": "#dd8452", "bucket": "#e6a0a2", "idle": "#eeeeee"}


def stress_strain_curves(data: object, indices: Sequence[int]) -> plt.Figure:
    """Tensile tests of a ddlab.data.StressStrainCurves set; x marks fracture, legend the targets."""
    strain, stress, flag = data.curves(indices)
    params = data.parameters(indices)
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for i in range(len(strain)):
        intact = flag[i] == 1
        line, = ax.plot(strain[i][intact] * 100, stress[i][intact], lw=1.2,
                        label=f"yield {params['yield'][i]:.0f} MPa, n = {params['exponent'][i]:.2f}")
        if not intact.all():
            last = np.flatnonzero(intact)[-1]
            ax.plot(strain[i][last] * 100, stress[i][last], "x", color=line.get_color(), ms=7)
    ax.set_xlabel("strain (%)")
    ax.set_ylabel("stress (MPa)")
    ax.set_title("Synthetic tensile tests (x: fracture; stress and flag are 0 after it)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def step_timeline(spans_by_rank: Sequence[Sequence[object]], title: str = "", unit: float = 1e3,
                  unit_name: str = "ms") -> plt.Figure:
    """One row per rank and track: phases of training steps, and allreduces in flight beside them.

    spans_by_rank: per rank, objects with name, start, end and track (ddlab.trace.Span).
    """
    rows = []
    for rank, spans in enumerate(spans_by_rank):
        tracks = list(dict.fromkeys(s.track for s in spans))
        rows += [(rank, track, [s for s in spans if s.track == track]) for track in tracks]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.4))
    end = max((s.end for _, _, spans in rows for s in spans), default=1.0) * unit
    for row, (_, _, spans) in enumerate(rows):
        for span in sorted(spans, key=lambda s: (s.start, -s.end)):  # enclosing spans first, nested on top
            kind, number = span.name, span.number
            width = (span.end - span.start) * unit
            ax.barh(row, width, left=span.start * unit, height=0.7,
                    color=_PHASE_COLOURS.get(kind, "#999999"), edgecolor="white", linewidth=0.4)
            if number is not None and width > end / 60:
                ax.text(span.start * unit + width / 2, row, str(number), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [f"rank {r}" + ("" if t == "main" else f" ({t})") for r, t, _ in rows],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit_name})")
    kinds = [k for k in _PHASE_COLOURS if any(s.name == k for _, _, ss in rows for s in ss)]
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=_PHASE_COLOURS[k]) for k in kinds], kinds, fontsize=7,
              ncol=len(kinds), loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / max(len(rows), 1)), frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def scaling_curves(ranks: Sequence[int], strong: Sequence[float], weak: Sequence[float] | None = None,
                   title: str = "") -> plt.Figure:
    """Speedup and efficiency from times per step (strong: fixed global work; weak: fixed work per rank)."""
    p, strong = np.asarray(ranks, dtype=float), np.asarray(strong, dtype=float)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(p, p, "k--", lw=1, label="ideal: speedup = P")
    left.plot(p, strong[0] / strong, "o-", label="strong scaling: T(1) / T(P)")
    left.set_ylabel("speedup")
    right.axhline(1.0, color="black", ls="--", lw=1, label="ideal")
    right.plot(p, strong[0] / (p * strong), "o-", label="strong: T(1) / (P T(P))")
    if weak is not None:
        weak = np.asarray(weak, dtype=float)
        right.plot(p, weak[0] / weak, "s-", label="weak: T(1) / T(P)")
    right.set_ylabel("efficiency")
    right.set_ylim(0, 1.15)
    for ax in (left, right):
        ax.set_xticks(p, [str(int(v)) for v in p])
        ax.set_xlabel("ranks P")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def time_breakdown(rows: Sequence[dict[str, float]], labels: Sequence[str], title: str = "",
                   unit: float = 1e3, unit_name: str = "ms") -> plt.Figure:
    """Stacked bars: one bar per row (a rank, a run), one segment per phase."""
    phases = list(dict.fromkeys(k for row in rows for k in row))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(rows) + 3), 3.6))
    bottom = np.zeros(len(rows))
    for phase in phases:
        values = np.array([row.get(phase, 0.0) for row in rows]) * unit
        ax.bar(range(len(rows)), values, 0.6, bottom=bottom, label=phase, color=_PHASE_COLOURS.get(phase))
        bottom += values
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel(f"time per step ({unit_name})")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return fig


def batch_size_tradeoff(batch_sizes: Sequence[int], epoch_times: Sequence[float], scores: Sequence[float],
                        title: str = "") -> plt.Figure:
    """Larger batches: shorter epochs (left), but fewer updates, so less learnt per epoch (right)."""
    b = np.asarray(batch_sizes, dtype=float)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
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
    return fig


def learning_curves(curves: dict[str, Sequence[float]], xlabel: str, ylabel: str, title: str = "") -> plt.Figure:
    """One line per label (e.g. R^2 after each epoch, per learning-rate rule)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for label, values in curves.items():
        ax.plot(np.arange(1, len(values) + 1), values, "o-", ms=4, label=label)
    ax.set_xticks(np.arange(1, max(map(len, curves.values()), default=0) + 1))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fusion_costs(pieces: Sequence[int], measured: Sequence[float], alpha: float, beta: float, nbytes: float,
                 marks: dict[str, int] | None = None) -> plt.Figure:
    """k allreduces of n/k bytes against one of n: measured ratio and (k alpha + n beta)/(alpha + n beta)."""
    k = np.asarray(pieces, dtype=float)
    fine = np.geomspace(k.min(), k.max(), 200)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(fine, (fine * alpha + nbytes * beta) / (alpha + nbytes * beta), "k--", lw=1,
            label="model (k alpha + n beta) / (alpha + n beta)")
    ax.plot(k, measured, "o", label="measured T(k pieces) / T(1 piece)")
    for name, value in (marks or {}).items():
        ax.axvline(value, color="gray", ls=":", lw=1)
        ax.text(value, ax.get_ylim()[1], f" {name}", rotation=90, va="top", fontsize=7, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_xticks(k, [str(int(v)) for v in k])
    ax.minorticks_off()
    ax.set_xlabel(f"allreduces k for the same {_byte_label(nbytes)}")
    ax.set_ylabel("time relative to one fused allreduce")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig

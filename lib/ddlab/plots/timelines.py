"""The Gantt chart of spans per rank (labs 04-07): what each rank did when."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import matplotlib.pyplot as plt

from ..runtime.trace import MAIN, Span

#: A colour per kind of span: training phases (labs 04-05) and pipeline ops (labs 06-07). Okabe and Ito's
#: colours (and greys), told apart by readers with any common colour-vision deficiency
#: (tests/test_plots_colours.py checks every pair under simulated protanopia, deuteranopia, tritanopia).
COLOURS = {
    "data": "#555555",
    "forward": "#0072B2",
    "backward": "#D55E00",
    "weight": "#000000",
    "allreduce": "#CC79A7",
    "optimizer": "#E69F00",
    "bucket": "#F0E442",
    "send": "#56B4E9",
    "recv": "#009E73",
    "idle": "#eeeeee",
    "other": "#bbbbbb",
}
_DARK = ("data", "forward", "backward", "recv")  # kinds whose numbers are written in white


def gantt(
    spans_by_rank: Sequence[Sequence[Span]],
    title: str = "",
    ax: plt.Axes | None = None,
    unit: float = 1e3,
    unit_name: str = "ms",
) -> plt.Figure:
    """One row per rank and track, one bar per span coloured by its kind, numbered (micro-batch, bucket).

    spans_by_rank: per rank, ddlab.runtime.trace.Spans. Nested spans are drawn over the ones
    that enclose them; spans on other tracks than the main one (an allreduce in flight)
    get rows of their own. unit, unit_name: seconds per axis unit and its name.
    """
    rows = []
    for rank, spans in enumerate(spans_by_rank):
        tracks = list(dict.fromkeys(s.track for s in spans)) or [MAIN]
        rows += [(rank, track, [s for s in spans if s.track == track]) for track in tracks]
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.4))
    else:
        fig = cast(plt.Figure, ax.figure)
    end = max((s.end for _, _, spans in rows for s in spans), default=1.0) * unit
    for row, (_, _, spans) in enumerate(rows):
        for span in sorted(spans, key=lambda s: (s.start, -s.end)):  # enclosing spans first, nested on top
            width = (span.end - span.start) * unit
            ax.barh(
                row,
                width,
                left=span.start * unit,
                height=0.7,
                color=COLOURS.get(span.name, "#999999"),
                edgecolor="white",
                linewidth=0.4,
            )
            if span.number is not None and width > end / 90:
                ax.text(
                    span.start * unit + width / 2,
                    row,
                    str(span.number),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if span.name in _DARK else "black",
                )
    ax.set_yticks(range(len(rows)), [f"rank {r}" + ("" if t == MAIN else f" ({t})") for r, t, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(f"time ({unit_name})")
    kinds = [k for k in COLOURS if any(s.name == k for _, _, spans in rows for s in spans)]
    ax.legend(
        [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in kinds],
        kinds,
        fontsize=7,
        ncol=max(len(kinds), 1),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 - 0.6 / max(len(rows), 1)),
        frameon=False,
    )
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def gantt_pair(top: Sequence[Sequence[Span]], bottom: Sequence[Sequence[Span]], titles: tuple[str, str]) -> plt.Figure:
    """Two Gantt charts one above the other (e.g. the busy clock and the wall clock of one run)."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 1.1 * len(top) + 2.6))
    gantt(top, titles[0], ax=axes[0])
    gantt(bottom, titles[1], ax=axes[1])
    fig.tight_layout()
    return fig

"""The Gantt chart of spans per rank (labs 04-07): what each rank did when."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import matplotlib.pyplot as plt

from ..runtime.trace import MAIN, Span
from .alt import describe, subplots

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


def _rows(spans_by_rank: Sequence[Sequence[Span]]) -> list[tuple[int, str, list[Span]]]:
    """(rank, track, its spans) per row of the chart: a rank's main track, then its other tracks."""
    rows = []
    for rank, spans in enumerate(spans_by_rank):
        tracks = list(dict.fromkeys(s.track for s in spans)) or [MAIN]
        rows += [(rank, track, [s for s in spans if s.track == track]) for track in tracks]
    return rows


def gantt(
    spans_by_rank: Sequence[Sequence[Span]],
    title: str = "",
    unit: float = 1e3,
    unit_name: str = "ms",
    *,
    alt: str,
) -> plt.Figure:
    """One row per rank and track, one bar per span coloured by its kind, numbered (micro-batch, bucket).

    spans_by_rank: per rank, ddlab.runtime.trace.Spans. Nested spans are drawn over the ones
    that enclose them; spans on other tracks than the main one (an allreduce in flight)
    get rows of their own. unit, unit_name: seconds per axis unit and its name. alt: what the
    chart shows (its text alternative; the kinds of span and the time axis are added to it).
    """
    fig, ax = subplots(figsize=(10, 0.5 * len(_rows(spans_by_rank)) + 1.4))
    _chart(ax, spans_by_rank, title, unit, unit_name)
    return describe(fig, alt)


def _chart(ax: plt.Axes, spans_by_rank: Sequence[Sequence[Span]], title: str, unit: float, unit_name: str) -> None:
    """Draw the Gantt chart of `gantt` into `ax`, and lay out its figure."""
    rows = _rows(spans_by_rank)
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
    cast(plt.Figure, ax.figure).tight_layout()


def gantt_pair(
    top: Sequence[Sequence[Span]], bottom: Sequence[Sequence[Span]], titles: tuple[str, str], *, alt: str
) -> plt.Figure:
    """Two Gantt charts one above the other (e.g. the busy clock and the wall clock of one run); alt as gantt's."""
    fig, axes = subplots(2, 1, figsize=(10, 1.1 * len(top) + 2.6))
    _chart(axes[0], top, titles[0], 1e3, "ms")
    _chart(axes[1], bottom, titles[1], 1e3, "ms")
    fig.tight_layout()
    return describe(fig, alt)

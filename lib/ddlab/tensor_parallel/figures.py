"""Lab 14's figure: one sub-layer of a transformer block split over t ranks, tensor and sequence parallel.

Each tensor is drawn as a square, the sequence down and the features across: grey if every
rank holds it whole, cut into horizontal stripes (one colour per rank) if split along the
sequence, into vertical stripes if split along the features (heads, hidden features), and as
a deck of t squares if each rank holds a partial sum of the whole. The collectives sit
between them as circles, with what they do forward and backward, named as in the papers:
f and g (Shoeybi et al., 2019, figure 3), and with sequence parallelism g and g-bar
(Korthikanti et al., MLSys 2023, figure 5: their g is an allgather).
"""

from __future__ import annotations

from typing import Any

from matplotlib.patches import Circle, Rectangle

from ..plots.alt import describe, subplots
from ..plots.helpers import arrow, rank_colour

#: (caption, layout) along one sub-layer; a layout is a tensor's ("whole", "sequence", "features",
#: "partial") or a collective's ("f", "g", "allgather", "reduce-scatter").
TENSOR_PARALLEL = [
    ("x", "whole"),
    ("LayerNorm", "whole"),
    ("f\nfwd: identity\nbwd: allreduce", "f"),
    ("column-parallel\nq, k, v by heads\n(MLP: fc)", "features"),
    ("attention per head\n(MLP: GELU)", "features"),
    ("row-parallel\nproj by rows:\npartial sums", "partial"),
    ("g\nfwd: allreduce\nbwd: identity", "g"),
    ("+ bias, dropout,\n+ x", "whole"),
]
SEQUENCE_PARALLEL = [
    ("x", "sequence"),
    ("LayerNorm", "sequence"),
    ("g\nfwd: allgather\nbwd: reduce-scatter", "allgather"),
    ("column-parallel\nq, k, v by heads\n(MLP: fc)", "features"),
    ("attention per head\n(MLP: GELU)", "features"),
    ("row-parallel\nproj by rows:\npartial sums", "partial"),
    ("$\\bar{g}$\nfwd: reduce-scatter\nbwd: allgather", "reduce-scatter"),
    ("+ bias, dropout,\n+ x", "sequence"),
]
COLLECTIVES = {"f": "#fde68a", "g": "#fca5a5", "allgather": "#fde68a", "reduce-scatter": "#fca5a5"}


def _tensor(ax: Any, x: float, layout: str, t: int, size: float = 0.8) -> None:
    """A (sequence x features) square at x, coloured by who holds what."""
    y = -size / 2
    if layout == "whole":
        ax.add_patch(Rectangle((x, y), size, size, fc="0.8", ec="black"))
    elif layout == "partial":
        step = 0.06
        for rank in reversed(range(t)):
            ax.add_patch(Rectangle((x + rank * step, y - rank * step), size, size, fc=rank_colour(rank), ec="black"))
    else:
        part = size / t
        for rank in range(t):
            if layout == "sequence":  # rank 0's rows at the top
                box = (x, y + size - (rank + 1) * part), size, part
            else:
                box = (x + rank * part, y), part, size
            ax.add_patch(Rectangle(*box, fc=rank_colour(rank), ec="black"))


def _panel(ax: Any, stages: list[tuple[str, str]], t: int, title: str) -> None:
    gap = 1.6
    for i, (caption, layout) in enumerate(stages):
        x = i * gap
        if layout in COLLECTIVES:
            ax.add_patch(Circle((x + 0.4, 0), 0.3, fc=COLLECTIVES[layout], ec="black"))
            name, rest = caption.split("\n", 1)
            ax.text(x + 0.4, 0, name, ha="center", va="center", fontsize=12, fontweight="bold")
            ax.text(x + 0.4, -0.62, rest, ha="center", va="top", fontsize=8)
        else:
            _tensor(ax, x, layout, t)
            ax.text(x + 0.4, -0.62, caption, ha="center", va="top", fontsize=8)
        if i:
            arrow(ax, ((i - 1) * gap + 0.9 + (0.1 if stages[i - 1][1] == "partial" else 0), 0), (x - 0.1, 0))
    ax.set(xlim=(-0.3, len(stages) * gap - 0.5), ylim=(-1.55, 0.75), aspect="equal")
    ax.set_title(title, fontsize=10)
    ax.axis("off")


def plot_split_block(t: int = 4, *, alt: str) -> Any:
    """One sub-layer (attention, or alike the MLP) of a block on t ranks: tensor parallel above, sequence below."""
    if t < 2:
        raise ValueError(f"a split needs at least 2 ranks, got t={t}")
    fig, axes = subplots(2, 1, figsize=(11, 5.6))
    _panel(axes[0], TENSOR_PARALLEL, t, "tensor parallel (Megatron-LM): one allreduce forward (g), one backward (f)")
    _panel(
        axes[1],
        SEQUENCE_PARALLEL,
        t,
        "tensor + sequence parallel: the allreduces become an allgather and a reduce-scatter; "
        "LayerNorm and dropout on sequence blocks",
    )
    legend = [Rectangle((0, 0), 1, 1, fc="0.8", ec="black")] + [
        Rectangle((0, 0), 1, 1, fc=rank_colour(r), ec="black") for r in range(t)
    ]
    fig.legend(
        legend,
        ["whole on every rank"] + [f"rank {r}'s part" for r in range(t)],
        loc="lower center",
        ncol=t + 1,
        fontsize=8,
        frameon=False,
    )
    fig.text(
        0.01,
        0.06,
        "squares: sequence down, features across; horizontal stripes = split along the sequence, "
        "vertical = along the features (heads), a deck = partial sums of the whole",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return describe(fig, alt)

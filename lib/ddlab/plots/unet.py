"""The UNet as a column of layers, coloured by the rank each belongs to (labs 06-07)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch

from .alt import describe, subplots
from .helpers import box

_STAGE_COLOURS = ("#a6cee3", "#fdbf6f", "#b2df8a", "#fb9a99", "#cab2d6", "#ffff99", "#1f78b4", "#33a02c")


def unet_diagram(names: Sequence[str], bounds: Sequence[int] | None = None, title: str = "", *, alt: str) -> plt.Figure:
    """The UNet's layers in a U (depth goes down), skip connections as arrows; coloured by stage if bounds given.

    names: layer names as ddlab.models.unet.layer_names gives them ('Conv', 'Down0', 'Up0', 'Head').
    """
    level, places = 0, []
    for name in names:
        places.append(level)
        level += name.startswith("Down") - name.startswith("Up")
    fig, ax = subplots(figsize=(max(7.0, 0.36 * len(names)), 3.4))
    stage_of = [0] * len(names)
    if bounds is not None:
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            stage_of[a:b] = [s] * (b - a)
    for i, (name, depth) in enumerate(zip(names, places)):
        colour = _STAGE_COLOURS[stage_of[i] % len(_STAGE_COLOURS)] if bounds is not None else "#e8f0fe"
        box(ax, i - 0.4, -depth - 0.3, 0.8, 0.6, name[0], colour)
        if i:
            ax.plot([i - 0.6, i - 0.4], [-places[i - 1], -depth], color="gray", lw=1)
    for i, name in enumerate(names):
        if name.startswith("Down"):
            j = names.index("Up" + name[4:])
            ax.add_patch(
                FancyArrowPatch(
                    (i, -places[i] + 0.32),
                    (j, -places[j] + 0.32),
                    arrowstyle="-|>",
                    mutation_scale=10,
                    connectionstyle="arc3,rad=-0.12",
                    color="tab:red",
                )
            )
    if bounds is not None:
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            ax.text(
                (a + b - 1) / 2,
                1.05,
                f"stage {s}",
                ha="center",
                fontsize=9,
                bbox=dict(fc=_STAGE_COLOURS[s % len(_STAGE_COLOURS)], ec="none"),
            )
    ax.text(
        -0.5, -max(places) - 0.55, "C conv+ReLU   D store skip, pool   U upsample, concat skip   H head", fontsize=8
    )
    ax.text(len(names) - 0.5, -max(places) - 0.55, "red: skip connections", ha="right", fontsize=8, color="tab:red")
    ax.set_xlim(-0.7, len(names) - 0.3)
    ax.set_ylim(-max(places) - 0.7, 1.4)
    ax.axis("off")
    ax.set_title(title or "UNet: encoder down, decoder up, skips across", fontsize=10)
    return describe(fig, alt)

"""Text alternatives: every figure the library draws or a lab shows carries one, through this module alone.

A figure function makes its figure with `subplots` (pyplot's, making a `Described` figure) and
returns `describe(fig, alt)`: the caller's sentence on what the figure shows, followed by what
the axes say (titles, axis labels and scales, legend entries), read off the drawn figure. A lab
cell that draws with matplotlib directly shows its figure with `show(fig, alt=...)`.

Shown in IPython, such a figure is displayed once, as one bundle (`bundle`):
- `text/plain`: the alternative, what text front ends and exports show in place of the image;
- `image/png`, with the alternative in its metadata (`{"image/png": {"alt": ...}}`: IPython's
  `Image(alt=...)` convention, which nbconvert's classic HTML turns into `<img alt>`);
- `text/html`: the same PNG as `<img alt="...">`. JupyterLab 4's image renderer ignores the
  output's metadata (it sets only the size), and HTML outranks PNG there, in Notebook 7, nbconvert
  and MyST-NB: so a screen reader in the lab itself reads the alternative.
"""

from __future__ import annotations

import html
from base64 import b64encode
from io import BytesIO
from typing import Any, cast

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

#: Shorter than this, a text alternative cannot say what a figure shows.
MIN_ALT = 20


class Described(Figure):
    """A matplotlib figure with its text alternative (`alt`), displayed in IPython with it (see `bundle`)."""

    alt: str | None = None

    def _ipython_display_(self) -> None:
        if not self.alt:
            raise ValueError(
                "this figure has no text alternative: return ddlab.plots.describe(fig, alt) from the function"
            )
        publish(self, self.alt)


def subplots(*args: Any, **kwargs: Any) -> tuple[Described, Any]:
    """pyplot.subplots, making a `Described` figure (describe it before returning it)."""
    fig, axes = plt.subplots(*args, FigureClass=Described, **kwargs)
    return cast(Described, fig), axes


def _panel(ax: Axes) -> str:
    """What one panel's title, axis labels and scales, and legend say; empty for a diagram without them."""
    parts = []
    for name, label, scale in (("x", ax.get_xlabel(), ax.get_xscale()), ("y", ax.get_ylabel(), ax.get_yscale())):
        if label:
            parts.append(f"{name}: {' '.join(label.split())}" + (f" ({scale} scale)" if scale != "linear" else ""))
    legend = ax.get_legend()
    if legend is not None and legend.get_texts():
        parts.append("key: " + ", ".join(t.get_text() for t in legend.get_texts()))
    if not parts:
        return ""
    title = " ".join(ax.get_title().split())
    return (f"Panel '{title}': " if title else "Axes: ") + "; ".join(parts) + "."


def check_alt(alt: object) -> str:
    """`alt` stripped, or a ValueError that says what a text alternative needs."""
    if not isinstance(alt, str) or len(alt.strip()) < MIN_ALT:
        raise ValueError(
            f"alt={alt!r}: give a figure a text alternative of {MIN_ALT}+ characters that says what it shows "
            "(what is drawn, and what the reader should see in it)"
        )
    return alt.strip()


def alternative(fig: Figure, alt: str) -> str:
    """A figure's text alternative: `alt` (checked), then what its axes say."""
    panels = " ".join(filter(None, (_panel(ax) for ax in fig.axes if ax.axison)))
    return check_alt(alt) + (" " + panels if panels else "")


def describe(fig: Figure, alt: str) -> Described:
    """The figure (made by `subplots`) with its text alternative: `alt`, then what its axes say."""
    if not isinstance(fig, Described):
        raise TypeError(
            "describe() takes a figure made by ddlab.plots.subplots; show a pyplot figure with show(fig, alt)"
        )
    fig.alt = alternative(fig, alt)
    return fig


def bundle(fig: Figure, alt: str) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The display bundle of a figure and its alternative: (data by MIME type, metadata), the PNG drawn once."""
    buffer = BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    png = b64encode(buffer.getvalue()).decode()
    data = {
        "image/png": png,
        "text/html": f'<img src="data:image/png;base64,{png}" alt="{html.escape(alt)}"/>',
        "text/plain": alt,
    }
    return data, {"image/png": {"alt": alt}}


def publish(fig: Figure, alt: str) -> None:
    """Display the figure once with its alternative, and close it so pyplot does not show it again."""
    from IPython.display import publish_display_data

    data, metadata = bundle(fig, alt)
    publish_display_data(data, metadata)
    plt.close(fig)


def show(fig: Figure, alt: str) -> None:
    """Show a figure a lab cell drew with matplotlib, with its text alternative (`alt`, then what its axes say)."""
    publish(fig, alternative(fig, alt))

"""Lab 09's figures: predicted against measured, and the planner's map.

The first is laid out as figure 2 of ParaDL's technical report (Kahira, Nguyen et al., "A
Model-driven Analysis of the Practical Limits of Large-scale DNN Training", paraDL-analysis
repository): predicted time by part beside the measured time.
"""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..plots.alt import describe, subplots
from .strategies import MEMORY

TIME_PARTS = ("compute", "communication", "bubble", "overhead")
COLOURS = {
    "compute": "#4c72b0",
    "communication": "#dd8452",
    "bubble": "#c7c7c7",
    "overhead": "#c44e52",
    "parameters": "#4c72b0",
    "gradients": "#55a868",
    "optimizer": "#8172b3",
    "activations": "#dd8452",
    "buffers": "#937860",
}

#: One colour per strategy the planner names, the same in every map (tab10's colours).
STRATEGY_COLOURS = {
    name: plt.get_cmap("tab10")(i)
    for i, name in enumerate(
        ("data", "spatial", "filter", "channel", "pipeline", "data x spatial", "data x filter", "data x pipeline")
    )
}


def _accuracy_label(accuracy: float, predicted: float, measured: float) -> str:
    """The accuracy, floored at 0%; below 0 (a prediction over twice the measurement) with the ratio too."""
    if accuracy >= 0 or not measured:
        return f"{accuracy:.0%}"
    return f"0%\n(pred {predicted / measured:.1f}x)"


def plot_validation(results: Sequence, *, alt: str) -> plt.Figure:
    """Per strategy: predicted time (stacked parts) beside measured, and the worst rank's memory likewise.

    The accuracy 1 - |pred - meas| / meas stands above each pair. `results`: `Validation`s.
    """
    fig, (left, right) = subplots(1, 2, figsize=(13, 4.2))
    x = np.arange(len(results))
    w = 0.38
    for ax, kind in ((left, "time"), (right, "memory")):
        top = 0.0
        for i, v in enumerate(results):
            if kind == "time":
                parts = {k: getattr(v.prediction, k) * 1e3 for k in TIME_PARTS}
                measured, acc = v.seconds * 1e3, v.time_accuracy
            else:
                worst = min(range(len(v.memory)), key=lambda r: v.memory_accuracies[r])
                parts = {k: v.prediction.memory[v.rank_kind[worst]][k] / 2**20 for k in MEMORY}
                measured, acc = v.measured_peak(worst) / 2**20, v.memory_accuracy
            bottom = 0.0
            for name, value in parts.items():
                ax.bar(x[i] - w / 2, value, w, bottom=bottom, color=COLOURS[name], label=name if i == 0 else None)
                bottom += value
            ax.bar(x[i] + w / 2, measured, w, color="#333333", label="measured" if i == 0 else None)
            ax.text(x[i], max(bottom, measured) * 1.03, _accuracy_label(acc, bottom, measured), ha="center", fontsize=8)
            top = max(top, bottom, measured)
        ax.set_ylim(0, top * 1.25)  # room for the labels above the tallest pair
        ax.set_xticks(x, [v.name.replace("(", "\n(") for v in results], fontsize=8)
        ax.set_ylabel("ms per iteration" if kind == "time" else "MiB, busiest-predicted rank")
        ax.set_title("time: predicted (left) vs measured" if kind == "time" else "peak memory per rank")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return describe(fig, alt)


def plot_plan_map(
    best: dict[tuple[int, int], str],
    devices: Sequence[int],
    sides: Sequence[int],
    title: str,
    *,
    alt: str,
) -> plt.Figure:
    """A grid of devices x image sides, each cell named by the planner's fastest feasible strategy."""
    unknown = sorted(set(best.values()) - set(STRATEGY_COLOURS))
    if unknown:
        raise ValueError(f"no colour for {unknown}: the map knows the planner's strategies {list(STRATEGY_COLOURS)}")
    blank = (1.0, 1.0, 1.0, 1.0)  # no feasible strategy
    grid = np.array([[STRATEGY_COLOURS.get(best.get((p, s), ""), blank) for p in devices] for s in sides])
    fig, ax = subplots(figsize=(12, 0.6 * len(sides) + 1.6))
    ax.imshow(grid, aspect="auto")
    for r, s in enumerate(sides):
        for c, p in enumerate(devices):
            label = best.get((p, s), "none fits")
            ax.text(c, r, label.replace(" x ", " x\n"), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(devices)), [str(d) for d in devices])
    ax.set_yticks(range(len(sides)), [str(s) for s in sides])
    ax.set_xlabel("devices")
    ax.set_ylabel("image side")
    ax.set_title(title)
    fig.tight_layout()
    return describe(fig, alt)


def plot_published(rows: Sequence, *, alt: str) -> plt.Figure:
    """ParaDL's published runs: predicted against measured epoch seconds, ParaDL's and this library's.

    One panel per model, log-log; on the diagonal a prediction is exact. `rows`: `paradl_abci.Row`s.
    """
    models = sorted({r.model for r in rows})
    fig, axes = subplots(1, len(models), figsize=(6 * len(models), 4.4), squeeze=False)
    markers = {"data x spatial": "o", "data x filter": "s", "filter": "^", "channel": "v"}
    for ax, model in zip(axes[0], models):
        chosen = [r for r in rows if r.model == model]
        for who, colour in (("paradl", "#937860"), ("ddlab", "#4c72b0")):
            for strategy, marker in markers.items():
                points = [r for r in chosen if r.strategy == strategy]
                ax.scatter(
                    [r.measured for r in points],
                    [getattr(r, who) for r in points],
                    marker=marker,
                    color=colour,
                    label=f"{'ParaDL' if who == 'paradl' else 'ddlab'}, {strategy}",
                )
        low = min(min(r.measured, r.paradl, r.ddlab) for r in chosen) / 1.5
        high = max(max(r.measured, r.paradl, r.ddlab) for r in chosen) * 1.5
        ax.plot([low, high], [low, high], color="#888888", lw=1)
        ax.set(xscale="log", yscale="log", xlabel="measured s / epoch", ylabel="predicted s / epoch", title=model)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle("ParaDL's ABCI runs (its technical report, Table VIII): predicted against measured")
    fig.tight_layout()
    return describe(fig, alt)

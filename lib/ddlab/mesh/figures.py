"""Lab 16's figure: each layout's step time and peak memory per rank, beside pure data parallelism's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import matplotlib.pyplot as plt

from ..plots.alt import describe, subplots
from ..runtime.memory import mib

if TYPE_CHECKING:
    from .training import MeshRun


def plot_layouts(runs: list[MeshRun], *, alt: str) -> plt.Figure:
    """Two panels: the step time of each layout, and its peak memory per rank (the largest and smallest rank's)."""
    fig, (time_ax, memory_ax) = subplots(1, 2, figsize=(9, 3.2))
    labels = [run.label for run in runs]
    where = range(len(runs))
    time_ax.bar(where, [run.seconds * 1e3 for run in runs], color="tab:blue")
    time_ax.set_ylabel("ms per step (slowest rank)")
    most = [max(run.peak_bytes) / 2**20 for run in runs]
    least = [min(run.peak_bytes) / 2**20 for run in runs]
    memory_ax.bar(where, most, color="tab:orange", label="largest rank")
    memory_ax.bar(where, least, color="tab:green", label="smallest rank")
    memory_ax.set_ylabel("peak MiB per rank")
    memory_ax.legend(fontsize=8)
    for ax in (time_ax, memory_ax):
        ax.set_xticks(list(where), labels, rotation=45, ha="right", fontsize=8)
        ax.set_xlabel("data x tensor x pipeline (x context)")
    time_ax.set_title("step time")
    memory_ax.set_title(f"memory (data parallel: {mib(max(runs[0].peak_bytes))})" if runs else "memory")
    fig.tight_layout()
    return describe(fig, alt)

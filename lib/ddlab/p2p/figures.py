"""Lab 01's figures: latency and bandwidth against message size."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..plots.alt import describe, subplots
from ..plots.helpers import byte_label, size_axis


def latency_bandwidth(
    nbytes: Sequence[float], seconds: Sequence[float], alpha: float, beta: float, *, alt: str
) -> plt.Figure:
    """Ping-pong times against the model T(n) = alpha + beta*n (log-log), and bandwidth n/T(n)."""
    n, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    dense = np.geomspace(max(n.min(), 1), n.max(), 200)
    model = alpha + beta * dense
    fig, (left, right) = subplots(1, 2, figsize=(10, 3.8))
    left.loglog(n, t * 1e6, "o", ms=4, label="measured (ping-pong)")
    left.loglog(
        dense, model * 1e6, "-", label=f"model: alpha = {alpha * 1e6:.3g} us, 1/beta = {1 / beta / 1e9:.3g} GB/s"
    )
    left.set_ylabel("one-way time (microseconds)")
    left.set_title("Time per message: alpha + beta * n", fontsize=10)
    right.semilogx(n, n / t / 1e9, "o", ms=4, label="measured n / T(n)")
    right.semilogx(dense, dense / model / 1e9, "-", label="model n / (alpha + beta n)")
    right.axhline(1 / beta / 1e9, color="gray", ls="--", lw=1, label="1 / beta (the asymptote)")
    half = alpha / beta
    if n.min() <= half <= n.max():
        right.axvline(half, color="gray", ls=":", lw=1, label=f"n_1/2 = alpha / beta = {byte_label(half)}")
    right.set_ylabel("bandwidth (GB/s)")
    right.set_title("Bandwidth: half of the peak at n_1/2", fontsize=10)
    for ax in (left, right):
        size_axis(ax, n, "message size")
    fig.tight_layout()
    return describe(fig, alt)

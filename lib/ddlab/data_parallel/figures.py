"""Lab 04's figures: the stress-strain data set."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from ..plots.alt import describe, subplots


def stress_strain_curves(data: Any, indices: Sequence[int], *, alt: str) -> plt.Figure:
    """Tensile tests of a ddlab.data.StressStrainCurves set; x marks fracture, legend the targets."""
    strain, stress, flag = data.curves(indices)
    params = data.parameters(indices)
    fig, ax = subplots(figsize=(7.5, 3.6))
    for i in range(len(strain)):
        intact = flag[i] == 1
        (line,) = ax.plot(
            strain[i][intact] * 100,
            stress[i][intact],
            lw=1.2,
            label=f"yield {params['yield'][i]:.0f} MPa, n = {params['exponent'][i]:.2f}",
        )
        if not intact.all():
            last = np.flatnonzero(intact)[-1]
            ax.plot(strain[i][last] * 100, stress[i][last], "x", color=line.get_color(), ms=7)
    ax.set_xlabel("strain (%)")
    ax.set_ylabel("stress (MPa)")
    ax.set_title("Synthetic tensile tests (x: fracture; stress and flag are 0 after it)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return describe(fig, alt)

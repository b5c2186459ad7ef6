"""The figures' colours stay apart for readers with a colour-vision deficiency.

Every pair of colours a figure sets side by side (the Gantt chart's kinds of span, the ranks'
colours) must differ by at least MIN_DELTA_E (CIE 1976 Delta E in CIELAB) as seen with normal
vision and under simulated protanopia, deuteranopia and tritanopia: the matrices of Machado,
Oliveira and Fernandes, "A Physiologically-based Model for Simulation of Color Vision
Deficiency", IEEE TVCG 15(6), 2009, Table 1 at severity 1.0, applied to linear sRGB.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from ddlab.plots.helpers import RANK_COLOURS
from ddlab.plots.timelines import COLOURS
from matplotlib.colors import to_rgb

SIMULATIONS = {
    "normal vision": np.eye(3),
    "protanopia": np.array(
        [[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216], [-0.003882, -0.048116, 1.051998]]
    ),
    "deuteranopia": np.array(
        [[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413], [-0.011820, 0.042940, 0.968881]]
    ),
    "tritanopia": np.array(
        [[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602], [0.004733, 0.691367, 0.303900]]
    ),
}
#: Below about 10, two small patches of colour are hard to tell apart at a glance.
MIN_DELTA_E = 10.0
_XYZ = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
_WHITE = np.array([0.95047, 1.0, 1.08883])


def _linear(colour: str) -> np.ndarray:
    c = np.array(to_rgb(colour))
    return np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)


def _lab(linear: np.ndarray) -> np.ndarray:
    t = (_XYZ @ linear) / _WHITE
    f = np.where(t > 0.008856, np.cbrt(t), 7.787 * t + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def closest_pair(colours: list[str]) -> tuple[float, str, str, str]:
    """(Delta E, vision, colour, colour) of the pair of colours that is hardest to tell apart."""
    return min(
        (float(np.linalg.norm(_lab(np.clip(m @ _linear(a), 0, 1)) - _lab(np.clip(m @ _linear(b), 0, 1)))), v, a, b)
        for v, m in SIMULATIONS.items()
        for a, b in itertools.combinations(colours, 2)
    )


@pytest.mark.parametrize(
    "name, colours", [("the Gantt chart's kinds", list(COLOURS.values())), ("the ranks", list(RANK_COLOURS))]
)
def test_every_pair_of_colours_is_told_apart_with_every_common_deficiency(name, colours):
    distance, vision, a, b = closest_pair(colours)
    assert distance >= MIN_DELTA_E, f"{name}: {a} and {b} differ by Delta E {distance:.1f} under {vision}"


def test_the_measure_catches_a_red_green_pair():
    """The seaborn-like blue, green and red the Gantt chart had (forward, backward, allreduce): red-green blind
    readers see the backward and the allreduce bars alike."""
    distance, vision, a, b = closest_pair(["#4c72b0", "#55a868", "#c44e52"])
    assert distance < MIN_DELTA_E and vision in ("protanopia", "deuteranopia") and {a, b} == {"#55a868", "#c44e52"}

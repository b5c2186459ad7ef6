"""Slab bounds in one process: whole through every pooling level, as even as possible, clear errors."""

from __future__ import annotations

import pytest
from ddlab.intra_layer import slab_bounds


@pytest.mark.parametrize(
    "height, size, levels", [(48, 3, 3), (112, 4, 3), (40, 4, 3), (13, 4, 0), (64, 1, 4), (96, 5, 2)]
)
def test_slabs_survive_every_pooling_level_and_differ_by_at_most_one_block(height, size, levels):
    bounds = slab_bounds(height, size, levels)
    unit = 2**levels
    assert bounds[0] == 0 and bounds[-1] == height and len(bounds) == size + 1
    rows = [b - a for a, b in zip(bounds, bounds[1:])]
    assert min(rows) >= unit and max(rows) - min(rows) <= unit
    assert all(b % unit == 0 for b in bounds)  # every slab stays whole through the pooling levels


def test_uneven_heights_give_uneven_slabs_not_an_error():
    assert slab_bounds(40, 4, 3) == [0, 16, 24, 32, 40]


@pytest.mark.parametrize("height, size, levels, says", [(36, 2, 3, "multiple of"), (16, 3, 3, "fewer ranks")])
def test_impossible_cuts_say_what_to_do(height, size, levels, says):
    with pytest.raises(ValueError, match=says):
        slab_bounds(height, size, levels)

"""The interleaved 1F1B schedule on one process: its replay's bubble is (p-1)/(v m+p-1), v = 1 is lab 07's
1F1B, each rank keeps at most its warm-up + 1 activations, and sizes it cannot run are refused."""

from __future__ import annotations

import pytest
from ddlab.pipeline import (
    bubble,
    chunk_in_flight,
    interleaved_1f1b,
    interleaved_bubble,
    one_f_one_b,
    simulate,
    simulate_interleaved,
)
from ddlab.pipeline.interleaved import warmup_forwards


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_the_replayed_bubble_is_the_formula(p: int, v: int) -> None:
    for m in (p, 2 * p, 4 * p):
        timeline = simulate_interleaved([interleaved_1f1b(p, m, r, v) for r in range(p)], v)
        assert bubble(timeline) == pytest.approx(interleaved_bubble(p, m, v), abs=1e-12)
        for r in range(p):
            assert chunk_in_flight(interleaved_1f1b(p, m, r, v)) == min(warmup_forwards(p, m, r, v) + 1, v * m)


def test_one_chunk_is_lab_07_s_1f1b() -> None:
    for p, m in ((4, 8), (3, 5), (2, 1)):
        ours = [[(kind, i) for kind, _, i in interleaved_1f1b(p, m, r, 1)] for r in range(p)]
        assert ours == [one_f_one_b(p, m, r) for r in range(p)]
        assert bubble(simulate(ours)) == pytest.approx(interleaved_bubble(p, m, 1))


def test_the_bubble_shrinks_by_v_of_the_compute() -> None:
    p, m = 4, 8
    for v in (1, 2, 4):
        share = interleaved_bubble(p, m, v)
        assert share / (1 - share) == pytest.approx((p - 1) / (v * m))  # of the ideal compute time


def test_sizes_it_cannot_run_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        interleaved_1f1b(4, 6, 0, 2)
    with pytest.raises(ValueError, match="0 <= rank < p"):
        interleaved_1f1b(2, 4, 2, 2)

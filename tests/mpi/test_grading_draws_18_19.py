"""Lab 18's checks graded on the grader's draw (ddlab.checks._draw): the library's answers pass under every seed
(and, with DDLAB_DRAWS=all, without one); answers fitted to the notebook's cases pass its check and fail a drawn
case, named with the seed.

Lab 19's checks run jobs of their own, so their draws are tested in one process: tests/test_grading_draws_19.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from ddlab import precision
from ddlab.checks import (
    CheckFailed,
    check_float8_allgather,
    check_loss_scale_step,
    check_quantize_float8,
    check_reduce_scatter_rounded,
)
from ddlab.checks._draw import Draw
from ddlab.precision import LossScale
from ddlab.runtime.reference import unguarded

#: By default the library's answers are graded on the three seeds only: without a seed each check runs the notebook's
#: cases, which the solution notebook and tests/mpi/test_precision_checks.py already run (a budget of test time);
#: DDLAB_DRAWS=all runs those too.
EVERY_RUN = os.environ.get("DDLAB_DRAWS") == "all"


RIGHT = [
    (check_loss_scale_step, unguarded(precision.loss_scale_step)),
    (check_quantize_float8, unguarded(precision.quantize_float8)),
    (check_float8_allgather, unguarded(precision.float8_allgather)),
    (check_reduce_scatter_rounded, unguarded(precision.reduce_scatter_rounded)),
]


@pytest.mark.parametrize("check, right", RIGHT, ids=lambda v: getattr(v, "__name__", ""))
def test_the_library_s_answer_passes_under_every_seed(comm, passes_on_every_seed, check, right):
    passes_on_every_seed(lambda: check(right), without=EVERY_RUN, comm=comm)


# Answers fitted to the notebook's cases ------------------------------------------------


def scaler_growing_after_3(comm, grads, state):
    """18.1 growing the scale after 3 clean steps, the interval of the notebook's cases that reach it."""
    unscaled, new = unguarded(precision.loss_scale_step)(comm, grads, state)
    if unscaled is None:
        return unscaled, new
    good = state.good_steps + 1
    if good == 3:
        return unscaled, LossScale(state.scale * state.factor, state.factor, state.interval, 0, state.skipped)
    return unscaled, LossScale(state.scale, state.factor, state.interval, good, state.skipped)


def cast_in_tiles_of_128(x, dtype, block, amax=None):
    """18.2 taking a 1 x bn tile to be DeepSeek-V3's 1 x 128, the notebook's only tile."""
    if block[0] == 1:
        block = (1, 128)
    return unguarded(precision.quantize_float8)(x, dtype, block, amax)


FITTED = [  # (check, the fitted answer, words the failure names beside the seed, what the seed must draw)
    (
        check_loss_scale_step,
        scaler_growing_after_3,
        ["the new state is", "LossScale(", "gradients of shapes", "seed"],
        None,
    ),
    (
        check_quantize_float8,
        cast_in_tiles_of_128,
        ["tiles, a ", "tensor, columns from"],
        lambda draw: draw.integer(2, 160, "tile") != 128,
    ),
]


@pytest.mark.parametrize("check, fitted, words, needs", FITTED, ids=lambda v: getattr(v, "__name__", ""))
def test_an_answer_fitted_to_the_notebook_passes_its_check_and_fails_the_grader_s_draw(
    comm, seed, seed_with, check, fitted, words, needs
):
    check(fitted, timeout=5.0)  # the notebook's own cases: it passes
    value = seed_with(needs, check.__name__.removeprefix("check_"))
    seed(value)
    with pytest.raises(CheckFailed) as failed:
        check(fitted, timeout=5.0)
    message = str(failed.value)
    for word in [*words, f"(the grader's draw, seed {value})"]:
        assert word in message, message


def test_the_drawn_cases_stay_in_the_lab_s_domain(grading_seeds):
    """The draw keeps what 18.1-18.4's texts promise: float32/float16 gradients as dtypes, positive summands,
    a tile of one row, a block of zeros in the small tensor, and an empty shard on one rank of several."""
    from ddlab.checks.precision import _cast_cases, _gather_cases, _scaler_cases, _summands

    for value in grading_seeds:
        draw = Draw(value, "any")
        for size in (1, 2, 4):
            cases = _scaler_cases(size, draw)
            assert [c.bad_rank is not None for c in cases] == [True, True, False, False, False]
            assert all(0 <= c.state.good_steps < c.state.interval for c in cases)
            assert cases[3].state.good_steps == cases[3].state.interval - 1, "the interval's last clean step"
            for _, bounds in _gather_cases(size, draw, "x"):
                assert len(bounds) == size + 1 and bounds[0] == 0 and bounds[-1] > 0
                assert all(a <= b for a, b in zip(bounds, bounds[1:]))
            uneven = _gather_cases(size, draw, "x")[1][1]
            assert size == 1 or any(a == b for a, b in zip(uneven, uneven[1:])), "an empty shard"
            _, low, high = _summands(uneven, draw)
            assert 0 < low < high
        cases = _cast_cases(draw)
        assert cases[1][2][0] == 1 and cases[0][2] == tuple(cases[0][1].shape)
        small = cases[3][1]
        assert bool((small == 0).any()), "a block of zeros"
        assert all(c[1].dtype == torch.float32 for c in cases)

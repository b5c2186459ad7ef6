"""Lab 11's QSGD check: wrong quantizers fail with the reason, valid alternatives pass (one process)."""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.checks import CheckFailed, check_qsgd
from ddlab.compression import qsgd, unqsgd
from ddlab.runtime.reference import unguarded

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
qsgd = unguarded(qsgd)
unqsgd = unguarded(unqsgd)


def qsgd_by_comparison(x, s, rng):
    """Valid: round up when a uniform draw falls below the fraction, in float64 inside."""
    if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or not 1 <= s <= 127:
        raise ValueError("s must be an int in 1..127")
    norm = np.linalg.norm(x.astype(np.float64))
    if norm == 0:
        return np.zeros(1, x.dtype), np.zeros(x.size, np.int8)
    ratio = np.abs(x.astype(np.float64)) / norm * s
    lower = np.floor(ratio)
    level = lower + (rng.random(x.size) < ratio - lower)
    return np.array([norm], x.dtype), np.where(x < 0, -level, level).astype(np.int8)


def unqsgd_float64_inside(norm, levels, s):
    """Valid: decodes in float64 and casts back to the norm's dtype."""
    return (norm.astype(np.float64)[0] * levels / s).astype(norm.dtype)


def qsgd_nearest(x, s, rng):
    """Rounds to the nearest level: no randomness, so biased."""
    norm, _ = qsgd(x, s, rng)
    if norm[0] == 0:
        return norm, np.zeros(x.size, np.int8)
    return norm, (np.sign(x) * np.rint(np.abs(x) / norm[0] * s)).astype(np.int8)


def qsgd_floor(x, s, rng):
    """Always rounds down: biased towards zero."""
    norm, _ = qsgd(x, s, rng)
    if norm[0] == 0:
        return norm, np.zeros(x.size, np.int8)
    return norm, (np.sign(x) * np.floor(np.abs(x) / norm[0] * s)).astype(np.int8)


def qsgd_max_norm(x, s, rng):
    """Scales by max|x| (the library's 8-bit quantizer) instead of QSGD's 2-norm."""
    scale = np.abs(x).max(initial=0)
    norm, levels = qsgd(x, s, rng)
    return np.array([scale], x.dtype), levels


def qsgd_global_random(x, s, rng):
    """Draws from NumPy's global generator: the seeded rng is ignored."""
    return qsgd(x, s, np.random.default_rng(np.random.randint(1 << 30)))


def qsgd_int64_levels(x, s, rng):
    norm, levels = qsgd(x, s, rng)
    return norm, levels.astype(np.int64)


def qsgd_float64_norm(x, s, rng):
    """Returns the norm in float64 whatever x's dtype."""
    norm, levels = qsgd(x, s, rng)
    return norm.astype(np.float64), levels


def qsgd_fixed_s(x, s, rng):
    """Ignores s: always 127 levels."""
    return qsgd(x, 127, rng)


def qsgd_normalises_in_place(x, s, rng):
    """Divides the caller's x by its norm in place."""
    norm, levels = qsgd(x, s, rng)
    if norm[0]:
        x /= norm[0]
    return norm, levels


def qsgd_accepts_any_s(x, s, rng):
    """No check on s: s = 0 divides by zero, s = 128 overflows int8."""
    norm = np.array([np.linalg.norm(x)], x.dtype)
    if norm[0] == 0:
        return norm, np.zeros(x.size, np.int8)
    level = np.floor(np.abs(x) / norm[0] * s + rng.random(x.size))
    return norm, (np.sign(x) * level).astype(np.int8)


def unqsgd_forgets_s(norm, levels, s):
    return levels.astype(norm.dtype) * norm[0]


def unqsgd_in_float64(norm, levels, s):
    return levels * (float(norm[0]) / s)


def test_reference_and_valid_alternatives_pass():
    check_qsgd(qsgd, unqsgd)
    check_qsgd(qsgd_by_comparison, unqsgd_float64_inside)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (qsgd_nearest, "biased"),
        (qsgd_floor, "levels\\[\\d+\\] is|biased"),
        (qsgd_max_norm, "2-norm"),
        (qsgd_global_random, "draw every random number from `rng`"),
        (qsgd_int64_levels, "int8"),
        (qsgd_float64_norm, "in x's dtype float32"),
        (qsgd_fixed_s, "levels\\[\\d+\\] is"),
        (qsgd_normalises_in_place, "changed x"),
        (qsgd_accepts_any_s, "raise ValueError|raised|divide"),
    ],
)
def test_wrong_qsgd_fails(wrong, says):
    with pytest.raises(CheckFailed, match=says):
        check_qsgd(wrong, unqsgd)


@pytest.mark.parametrize("wrong, says", [(unqsgd_forgets_s, "unqsgd"), (unqsgd_in_float64, "dtype float64")])
def test_wrong_unqsgd_fails(wrong, says):
    with pytest.raises(CheckFailed, match=says):
        check_qsgd(qsgd, wrong)


def test_stub_raises_not_implemented():
    def stub(x, s, rng):
        raise NotImplementedError("Exercise 11.4: qsgd")

    with pytest.raises(NotImplementedError, match="11.4"):
        check_qsgd(stub, unqsgd)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("qsgd", "ddlab.compression.qsgd", (unqsgd,)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)

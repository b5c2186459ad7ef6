"""ddlab.p2p in one process: the alpha-beta fit, sizes and repeats; the fit check on wrong fits."""

from __future__ import annotations

import numpy as np
import pytest
from ddlab import p2p
from ddlab.checks import CheckFailed, check_fit_alpha_beta
from ddlab.runtime.reference import unguarded


def test_default_sizes_double_from_8_bytes_to_64_mib():
    sizes = p2p.default_sizes()
    assert sizes[0] == 8 and sizes[-1] == 64 * 2**20
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))


def test_default_repeats_shrink_with_size_but_stay_above_two():
    repeats = [p2p.default_repeats(n) for n in p2p.default_sizes()]
    assert repeats == sorted(repeats, reverse=True)
    assert repeats[0] > repeats[-1] >= 3
    assert p2p.default_repeats(0) == repeats[0]


def test_fit_recovers_alpha_and_beta_from_exact_data():
    n = np.array(p2p.default_sizes(), dtype=float)
    alpha, beta = p2p.fit_alpha_beta(n, 3e-6 + n / 10e9)
    assert alpha == pytest.approx(3e-6, rel=1e-9)
    assert beta == pytest.approx(1 / 10e9, rel=1e-9)


def test_fit_recovers_alpha_and_beta_from_noisy_data():
    n = np.array(p2p.default_sizes(), dtype=float)
    noise = 1 + 0.05 * np.random.default_rng(0).standard_normal(n.size)
    alpha, beta = p2p.fit_alpha_beta(n, (3e-6 + n / 10e9) * noise)
    assert alpha == pytest.approx(3e-6, rel=0.1)
    assert beta == pytest.approx(1 / 10e9, rel=0.1)


def test_fit_minimises_the_relative_squared_error():
    n = np.array(p2p.default_sizes(), dtype=float)
    t = (2e-6 + n / 4e9) * (1 + 0.2 * np.random.default_rng(1).random(n.size))
    best = p2p.fit_alpha_beta(n, t)

    def cost(alpha, beta):
        return np.sum(((alpha + beta * n - t) / t) ** 2)

    for da, db in ((1.01, 1), (0.99, 1), (1, 1.01), (1, 0.99)):
        assert cost(best[0] * da, best[1] * db) > cost(*best)


def test_fit_of_two_points_is_the_line_through_them():
    alpha, beta = p2p.fit_alpha_beta([0, 1000], [1e-6, 2e-6])
    assert alpha == pytest.approx(1e-6) and beta == pytest.approx(1e-9)


def test_fit_accepts_lists_and_returns_floats():
    alpha, beta = p2p.fit_alpha_beta([8, 64, 512], [1.0, 1.5, 5.0])
    assert type(alpha) is float and type(beta) is float


@pytest.mark.parametrize(
    "nbytes, seconds, words",
    [
        ([8, 16], [1e-6], "one time per size"),
        ([8], [1e-6], "two or more different sizes"),
        ([8, 8, 8], [1e-6, 2e-6, 3e-6], "two or more different sizes"),
        ([8, 16], [1e-6, 0.0], "times > 0"),
        ([8, 16], [1e-6, -1e-6], "times > 0"),
        ([-8, 16], [1e-6, 2e-6], "sizes must be >= 0"),
        ([8, 16], [1e-6, float("nan")], "finite"),
        ([8, float("inf")], [1e-6, 2e-6], "finite"),
    ],
)
def test_fit_rejects_bad_input_with_a_reason(nbytes, seconds, words):
    with pytest.raises(ValueError, match=words):
        p2p.fit_alpha_beta(nbytes, seconds)


# The fit check ------------------------------------------------------------------------
def test_fit_check_passes_the_reference(capsys):
    check_fit_alpha_beta(unguarded(p2p.fit_alpha_beta))
    assert capsys.readouterr().out.startswith("passed:")


def first_and_last(nbytes, seconds):
    beta = (seconds[-1] - seconds[0]) / (nbytes[-1] - nbytes[0])
    return seconds[0] - beta * nbytes[0], beta


def ordinary_least_squares(nbytes, seconds):
    beta, alpha = np.polyfit(nbytes, seconds, 1)
    return alpha, beta


@pytest.mark.parametrize("wrong", [first_and_last, ordinary_least_squares])
def test_fit_check_catches_fits_that_are_not_the_relative_least_squares(wrong):
    with pytest.raises(CheckFailed, match="least-squares fit of relative errors"):
        check_fit_alpha_beta(wrong)


def test_fit_check_catches_a_fit_blind_to_an_outlier_in_the_middle():
    def ignores_the_middle(nbytes, seconds):
        keep = np.r_[: len(nbytes) // 2, len(nbytes) // 2 + 1 : len(nbytes)]
        return unguarded(p2p.fit_alpha_beta)(np.asarray(nbytes)[keep], np.asarray(seconds)[keep])

    with pytest.raises(CheckFailed, match="least-squares fit"):
        check_fit_alpha_beta(ignores_the_middle)


@pytest.mark.parametrize("wrong", [lambda n, t: 1e-6, lambda n, t: (1e-6,), lambda n, t: None])
def test_fit_check_catches_a_result_that_is_not_two_numbers(wrong):
    with pytest.raises(CheckFailed, match="expected a tuple"):
        check_fit_alpha_beta(wrong)


def test_fit_check_lets_the_stub_through():
    def stub(nbytes, seconds):
        raise NotImplementedError("Exercise 1.4 is not done yet")

    with pytest.raises(NotImplementedError):
        check_fit_alpha_beta(stub)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("fit_alpha_beta", "ddlab.p2p.fit_alpha_beta", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)

"""Allreduce cost models in one process, and the multi-rank allreduce tests on 6 ranks.

tests/test_mpi_suites.py runs tests/mpi/ on 4 and 3 ranks; the fix-up for rank counts
that are not a power of two also needs 5 and 6 (6 = 4 + 2 surplus ranks), so the
allreduce files run here once more on 6 ranks (their sub-communicators cover 5 too).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from ddlab.allreduce import cost
from ddlab.allreduce.cost import Link, crossover, predict, terms
from ddlab.runtime.mpi import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

ALGORITHMS = ["naive", "tree", "recursive_doubling", "ring", "rabenseifner"]


@pytest.mark.parametrize(
    "name, want",
    [
        ("naive", (6, 6.0, 3.0)),
        ("tree", (4, 4.0, 2.0)),
        ("recursive_doubling", (2, 2.0, 2.0)),
        ("ring", (6, 1.5, 0.75)),
        ("rabenseifner", (4, 1.5, 0.75)),
        ("lower_bound", (2, 1.5, 0.75)),
    ],
)
def test_four_rank_terms_are_the_textbook_ones(name: str, want: tuple[float, float, float]) -> None:
    got = terms(name, 4, 1.0)
    assert (got.messages, float(got.bytes), float(got.reduced)) == want


def test_the_fold_costs_two_messages_of_n_and_one_add() -> None:
    six, four = terms("rabenseifner", 6, 1.0), terms("rabenseifner", 4, 1.0)
    assert (six.messages - four.messages, six.bytes - four.bytes, six.reduced - four.reduced) == (2, 2, 1)
    assert terms("recursive_doubling", 6, 1.0).messages == 4


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 64), nbytes=st.floats(0, 2**30))
def test_no_algorithm_beats_the_lower_bound(size: int, nbytes: float) -> None:
    bound = terms("lower_bound", size, nbytes)
    for name in ALGORITHMS:
        got = terms(name, size, nbytes)
        assert got.messages >= bound.messages
        assert got.bytes >= bound.bytes * (1 - 1e-12)
        assert got.reduced >= bound.reduced * (1 - 1e-12)


def test_ring_meets_the_bandwidth_bound_and_rabenseifner_on_powers_of_two() -> None:
    for size in (2, 3, 4, 5, 8):
        assert math.isclose(terms("ring", size, 1.0).bytes, terms("lower_bound", size, 1.0).bytes)
    assert math.isclose(terms("rabenseifner", 8, 1.0).bytes, terms("lower_bound", 8, 1.0).bytes)


def test_crossover_is_where_the_lines_meet() -> None:
    machine = Link(alpha=1e-6, beta=1e-10, gamma=0.0)
    at = crossover("recursive_doubling", "rabenseifner", 4, machine)
    assert at == pytest.approx(2e-6 / 0.5e-10)
    assert predict("recursive_doubling", 4, at, machine) == pytest.approx(predict("rabenseifner", 4, at, machine))
    assert crossover("rabenseifner", "recursive_doubling", 4, machine) is None
    assert crossover("ring", "ring", 4, machine) is None


def test_every_collective_has_its_critical_path() -> None:
    p, n, log_p = 6, 600.0, 3
    rs = cost.collective_terms("reduce_scatter", p, n, "ring")
    assert (rs.messages, rs.bytes, rs.reduced) == (5, 500, 500)
    assert cost.collective_terms("reduce_scatter", p, n).messages == log_p  # recursive halving by default
    ag = cost.collective_terms("allgather", p, n, "ring")
    assert (ag.messages, ag.bytes, ag.reduced) == (5, 500, 0)
    # the ring allreduce is its reduce-scatter then its allgather
    assert (rs + ag).messages == terms("ring", p, n).messages
    assert math.isclose((rs + ag).bytes, terms("ring", p, n).bytes)
    bcast = cost.collective_terms("broadcast", p, n)
    assert (bcast.messages, bcast.bytes) == (log_p, log_p * n)
    a2a = cost.collective_terms("alltoall", p, n)
    assert (a2a.messages, a2a.bytes) == (5, 500)
    link = Link(alpha=2.0, beta=0.5, gamma=0.25)
    assert cost.collective_seconds("p2p", p, 8, link) == 2.0 + 4.0
    assert link.seconds(8) == 2.0 + 4.0
    assert cost.collective_seconds("allreduce", p, n, link) == pytest.approx(
        2 * log_p * 2.0 + 2 * 500 * 0.5 + 500 * 0.25
    )  # halving-doubling by default
    for op in cost.COLLECTIVES:
        assert cost.collective_seconds(op, 1, n, link) == (link.seconds(n) if op == "p2p" else 0.0)
    with pytest.raises(ValueError, match="reduce_scatter"):
        cost.collective_terms("scatter_reduce", p, n)
    with pytest.raises(ValueError, match="ring"):
        cost.collective_terms("allgather", p, n, "tree")


def test_unknown_model_says_which_exist() -> None:
    with pytest.raises(ValueError, match="ring"):
        terms("butterfly", 4, 1.0)


def test_bus_bandwidth_scales_by_two_p_minus_one_over_p() -> None:
    assert cost.bus_bandwidth(1e9, 1.0, 4) == pytest.approx(1.5e9)


def test_machine_measurements_are_positive() -> None:
    assert cost.measure_gamma(nbytes=2**16, repeats=2) > 0
    assert cost.measure_memcpy_bandwidth(nbytes=2**16, repeats=2) > 0


MPI_FILES = [Path(__file__).parent / "mpi" / name for name in ("test_allreduce.py", "test_allreduce_checks.py")]
SIX_RANK_TIMEOUT = 420


@pytest.mark.timeout(SIX_RANK_TIMEOUT + 60)
def test_allreduce_on_six_ranks() -> None:
    """6 ranks on a small machine are slow: the deadlock test (a 20 s wait) runs on 3 and 4 only."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        *map(str, MPI_FILES),
        "--mpi-suite",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:warnings",
        "-k",
        "not deadlock",
    ]
    try:
        done = run_ranks(6, command, timeout=SIX_RANK_TIMEOUT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the allreduce tests did not finish on 6 ranks in {SIX_RANK_TIMEOUT} s:\n{err.output}")
    assert done.returncode == 0, f"the allreduce tests failed on 6 ranks:\n{done.stdout[-20000:]}"

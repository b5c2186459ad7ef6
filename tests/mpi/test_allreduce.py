"""ddlab.allreduce under mpiexec: every algorithm, any rank count, length and dtype.

Examples come from hypothesis, derandomized so every rank draws the same ones; each
example runs on the first P ranks of the world and all ranks agree on the outcome
before asserting, so a failure on one rank fails the example everywhere.
With 4 or fewer ranks, P runs over 1..world; on more, over 5..world (the smaller
counts are covered by the 3- and 4-rank runs).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
from ddlab.allreduce import ALGORITHMS, allreduce_mpi, cost
from ddlab.allreduce.algorithms import doubling_steps
from ddlab.checks import check_allreduce_rabenseifner, check_allreduce_recursive_doubling, check_allreduce_ring
from ddlab.checks._core import run_counted
from ddlab.runtime.counting import rounds
from ddlab.runtime.reference import unguarded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
SIZES = list(range(1, WORLD.size + 1)) if WORLD.size <= 4 else list(range(5, WORLD.size + 1))
DTYPES = [np.float32, np.float64, np.int64]
COLLECTIVE = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=40 if WORLD.size <= 4 else 8,
    suppress_health_check=list(HealthCheck),  # timing-based checks could differ between ranks
)
lengths = st.integers(0, 70) | st.sampled_from([0, 1, 2, 1000, 4099])


def on_first(size: int, body: Callable[[MPI.Comm], str | None]) -> list[str]:
    """Run body on the first `size` ranks; every rank gets every problem found (empty if none).

    A body that raises on one rank while another waits for it would hang: the runner's
    timeout ends that. Bodies that count messages go through run_counted, which cannot hang.
    """
    sub = WORLD.Split(0 if WORLD.rank < size else MPI.UNDEFINED, WORLD.rank)
    problem = None
    if sub != MPI.COMM_NULL:
        try:
            problem = body(sub)
        except Exception as err:  # reported by every rank below, so none waits alone
            problem = f"{type(err).__name__}: {err}"
        finally:
            sub.Free()
    return [p for p in WORLD.allgather(problem) if p]


def inputs(n: int, dtype: type, size: int, seed: int) -> list[np.ndarray]:
    """Every rank's input: random floats (exercising rounding) or integers."""
    rngs = [np.random.default_rng([seed, rank]) for rank in range(size)]
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(n).astype(dtype) for rng in rngs]
    return [rng.integers(-(2**40), 2**40, n) for rng in rngs]


@pytest.mark.parametrize("name", ALGORITHMS)
@COLLECTIVE
@given(n=lengths, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 999))
def test_every_rank_gets_the_same_sum(name: str, n: int, dtype: type, seed: int) -> None:
    """On every rank count in SIZES: the sum, new and identical on all ranks, x untouched."""
    fn = ALGORITHMS[name]

    def body(comm: MPI.Comm) -> str | None:
        size = comm.Get_size()
        xs = inputs(n, dtype, size, seed)
        x = xs[comm.rank]
        before = x.copy()
        out = fn(comm, x)  # the real communicator: the path that is timed against MPI
        exact = np.sum(np.stack(xs).astype(np.float64 if dtype != np.int64 else np.int64), axis=0)
        copies = comm.allgather(out.tobytes())
        if not np.array_equal(x, before):
            return f"P={size}: x changed"
        if out is x or np.shares_memory(out, x) or out.dtype != x.dtype or out.shape != x.shape:
            return f"P={size}: not a new array of x's shape and dtype: {out.dtype} {out.shape}"
        if len(set(copies)) != 1:
            return f"P={size}: ranks hold different results (they would drift apart in training)"
        scale = np.sum(np.abs(np.stack(xs)), axis=0, dtype=np.float64)
        tolerance = 0 if dtype == np.int64 else size * np.finfo(dtype).eps * scale
        if np.any(np.abs(out - exact) > tolerance):
            return f"P={size}: wrong sum at {np.flatnonzero(np.abs(out - exact) > tolerance)[:5]}"
        return None

    assert [problem for size in SIZES for problem in on_first(size, body)] == []


@pytest.mark.parametrize("name", ALGORITHMS)
@COLLECTIVE
@given(
    size=st.sampled_from([s for s in SIZES if s > 1]),
    n=st.integers(0, 9),
    mismatch=st.sampled_from(["length", "dtype", "same bytes", "2-D", "list"]),
    culprit=st.integers(0, 5),
)
def test_mismatched_inputs_raise_the_same_error_everywhere(
    name: str, size: int, n: int, mismatch: str, culprit: int
) -> None:
    culprit %= size

    def body(comm: MPI.Comm) -> str | None:
        x = np.ones(n, dtype=np.float64)
        if comm.rank == culprit:
            x = {
                "length": np.ones(n + 1),
                "dtype": x.astype(np.float32),
                "same bytes": x.view(np.int64),  # same length and itemsize: only the dtype's kind tells them apart
                "2-D": x.reshape(1, n),
                "list": list(x),
            }[mismatch]
        try:
            ALGORITHMS[name](comm, x)
        except ValueError as err:
            messages = comm.allgather(str(err))
            return None if len(set(messages)) == 1 and f"rank {culprit}" in messages[0] else f"{messages}"
        comm.allgather(None)
        return "no error"

    assert on_first(size, body) == []


def test_mpi_allreduce_wrapper_matches() -> None:
    x = np.arange(10.0) + WORLD.rank
    assert np.array_equal(allreduce_mpi(WORLD, x), np.arange(10.0) * WORLD.size + sum(range(WORLD.size)))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_critical_path_matches_the_cost_model(name: str) -> None:
    """Messages on the critical path are the model's alpha terms; bytes never beat the lower bound.

    Reduce-then-broadcast receives at the root one message after another, each costing
    an alpha: counted with one_receive_at_a_time. The exchanges of the others overlap
    a send and a receive (Sendrecv), one alpha for both.
    """
    serial = name in ("naive", "tree")
    for size in SIZES:
        n = 24 * size

        def body(comm: MPI.Comm, size: int = size, n: int = n) -> str | None:  # this iteration's size and n
            _, traffic = run_counted(comm, ALGORITHMS[name], (np.ones(n),), name)
            model = cost.terms(name, size, n * 8)
            heaviest = max(t.bytes_sent for t in traffic)
            path = rounds(traffic, one_receive_at_a_time=serial)
            if path != model.messages:
                return f"P={size}: {path} rounds, model says {model.messages}"
            if heaviest < cost.terms("lower_bound", size, n * 8).bytes:
                return f"P={size}: a rank sent {heaviest} B, below the lower bound"
            exact = name == "ring" or (name == "rabenseifner" and size & (size - 1) == 0)
            if exact and heaviest != model.bytes:
                return f"P={size}: the busiest rank sent {heaviest} B, model says {model.bytes}"
            return None

        assert on_first(size, body) == []


@pytest.mark.parametrize(
    "check, reference",
    [
        (check_allreduce_recursive_doubling, ALGORITHMS["recursive_doubling"]),
        (check_allreduce_ring, ALGORITHMS["ring"]),
        (check_allreduce_rabenseifner, ALGORITHMS["rabenseifner"]),
    ],
)
def test_checks_pass_the_references(check: Callable, reference: Callable, capsys: pytest.CaptureFixture) -> None:
    check(unguarded(reference))  # the library's answer as a student's would run (the checks refuse it marked)
    out = capsys.readouterr().out
    assert ("passed:" in out) == (WORLD.rank == 0)


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("n", [3, 8188, 131_068])
def test_a_longer_vector_on_one_rank_raises_without_overflowing(name: str, n: int) -> None:
    """A rank whose vector is longer than its partners': the same error everywhere, never a receive that
    overflows. Recursive doubling carries the agreement in its messages, so its receives meet the longer
    vector itself: 8188 float64 fill exactly the 64 KiB frame kept between calls and 8189 do not; 131 068
    fill exactly one 1 MiB message, and 131 069 travel as header then data, past MPI's eager limit."""
    for culprit in range(WORLD.size):

        def body(comm: MPI.Comm, culprit: int = culprit) -> str | None:
            x = np.ones(n + (comm.rank == culprit))
            try:
                ALGORITHMS[name](comm, x)
            except ValueError as err:
                messages = comm.allgather(str(err))
                return (
                    None if len(set(messages)) == 1 and f"rank {culprit} has {n + 1}" in messages[0] else f"{messages}"
                )
            comm.allgather(None)
            return "no error"

        assert on_first(WORLD.size, body) == []


def test_recursive_doubling_keeps_its_buffers_but_returns_new_arrays() -> None:
    """Its message buffers stay with the communicator between calls: each result is still the
    caller's own (a later call of any size or dtype leaves it alone), and x is never touched."""
    x = np.arange(100, dtype=np.int64) + WORLD.rank
    first = ALGORITHMS["recursive_doubling"](WORLD, x)
    want = np.arange(100, dtype=np.int64) * WORLD.size + sum(range(WORLD.size))
    second = ALGORITHMS["recursive_doubling"](WORLD, x * 2)
    third = ALGORITHMS["recursive_doubling"](WORLD, np.ones(7, dtype=np.float32))
    assert np.array_equal(first, want) and np.array_equal(second, 2 * want)
    assert np.array_equal(third, np.full(7, WORLD.size, dtype=np.float32)) and third.dtype == np.float32
    assert not np.shares_memory(first, second) and np.array_equal(x, np.arange(100) + WORLD.rank)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_strided_view_sums_as_its_copy(name: str) -> None:
    """x[::2] is not contiguous, so no message can be sent from it directly: the result still equals the sum."""
    x = np.arange(20, dtype=np.float32) + WORLD.rank
    got = ALGORITHMS[name](WORLD, x[::2])
    assert np.array_equal(got, np.arange(0, 20, 2, dtype=np.float32) * WORLD.size + sum(range(WORLD.size)))


def test_the_breakdown_times_recursive_doublings_own_messages() -> None:
    """bench/allreduce.py's and lab 03's bare message loop follows the reference's pattern, peer for peer."""
    _, traffic = run_counted(WORLD, ALGORITHMS["recursive_doubling"], (np.ones(10),), "recursive_doubling")
    mine = traffic[WORLD.rank]
    pattern = [(e.kind, e.peer) for e in mine.events]
    expected = []
    for kind, peer in doubling_steps(WORLD.rank, WORLD.size):
        expected += [("send", peer), ("recv", peer)] if kind == "swap" else [(kind, peer)]
    assert pattern == expected

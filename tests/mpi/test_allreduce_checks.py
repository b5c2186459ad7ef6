"""Lab 03's checks catch wrong allreduces: each plausible mistake fails with CheckFailed, never hangs.

Every rank runs the same tests; the checks themselves make all ranks agree.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
from ddlab.allreduce import (
    allreduce_recursive_doubling,
    allreduce_ring,
    fold_in,
    fold_out,
    largest_power_of_two,
    member_rank,
)
from ddlab.checks import (
    CheckFailed,
    check_allreduce_rabenseifner,
    check_allreduce_recursive_doubling,
    check_allreduce_ring,
)
from ddlab.runtime.blocks import block_bounds
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
allreduce_recursive_doubling = unguarded(allreduce_recursive_doubling)
allreduce_ring = unguarded(allreduce_ring)

WORLD = MPI.COMM_WORLD


def _ring_steps(rank: int, size: int, step: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """(dest, source, chunk sent, chunk received) in reduce-scatter and in allgather step `step`."""
    right, left = (rank + 1) % size, (rank - 1) % size
    return (
        (right, left, (rank - step) % size, (rank - step - 1) % size),
        (right, left, (rank + 1 - step) % size, (rank - step) % size),
    )


def _direct_steps(rank: int, size: int, step: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Pairwise exchange: send each rank the chunk it will own, then send it my own chunk."""
    dest, source = (rank + step + 1) % size, (rank - step - 1) % size
    return (dest, source, dest, rank), (dest, source, rank, source)


def _ring(comm, x, steps=_ring_steps, end_shift: int = 0) -> np.ndarray:
    """A reduce-scatter + allgather with pluggable partners, chunk ends moved by `end_shift`."""
    work, rank, size = x.copy(), comm.Get_rank(), comm.Get_size()
    bounds = block_bounds(work.size, size)
    chunk = [work[bounds[c] : max(bounds[c], bounds[c + 1] + end_shift)] for c in range(size)]
    for phase in (0, 1):
        for step in range(size - 1):
            dest, source, send, receive = steps(rank, size, step)[phase]
            incoming = np.empty_like(chunk[receive])
            comm.Sendrecv(chunk[send].copy(), dest=dest, recvbuf=incoming, source=source)
            if phase == 0:
                chunk[receive] += incoming
            else:
                chunk[receive][...] = incoming
    return work


def ring_not_a_ring(comm, x):
    """Same message count and bytes as a ring, but sent straight to every rank (pairwise exchange)."""
    return _ring(comm, x, _direct_steps)


def ring_off_by_one(comm, x):
    """Chunk ends one short of the boundary: the last item of every chunk is never summed."""
    return _ring(comm, x, end_shift=-1)


def ring_of_whole_arrays(comm, x):
    """Passes the whole vector around the ring P-1 times: right sum, P-1 messages of n items."""
    rank, size = comm.Get_rank(), comm.Get_size()
    total, passing = x.copy(), x.copy()
    for _ in range(size - 1):
        incoming = np.empty_like(passing)
        comm.Sendrecv(passing, dest=(rank + 1) % size, recvbuf=incoming, source=(rank - 1) % size)
        total += incoming
        passing = incoming
    return total


def ring_in_place(comm, x):
    """A correct ring that works in x itself instead of a copy."""
    x[...] = allreduce_ring(comm, x)
    return x


def ring_that_deadlocks(comm, x):
    """Every rank receives before it sends: nobody ever sends."""
    rank, size = comm.Get_rank(), comm.Get_size()
    incoming = np.empty_like(x)
    if size > 1:
        comm.Recv(incoming, source=(rank - 1) % size)
        comm.Send(x, dest=(rank + 1) % size)
    return x + incoming if size > 1 else x.copy()


def doubling_with_wrong_partner(comm, x):
    """Shifts by 2^k instead of XOR 2^k (with the fold): the right sum on powers of two, wrong partners."""
    work, scratch = x.copy(), np.empty_like(x)
    group, size = fold_in(comm, work, scratch), comm.Get_size()
    if group is not None:
        pof2, distance = largest_power_of_two(size), 1
        while distance < pof2:
            dest, source = member_rank((group + distance) % pof2, size), member_rank((group - distance) % pof2, size)
            comm.Sendrecv(work, dest=dest, recvbuf=scratch, source=source)
            work += scratch
            distance *= 2
    fold_out(comm, work, group)
    return work


def doubling_without_fold(comm, x):
    """Recursive doubling that skips partners beyond the last rank instead of folding."""
    rank, size = comm.Get_rank(), comm.Get_size()
    work, scratch, distance = x.copy(), np.empty_like(x), 1
    while distance < size:
        partner = rank ^ distance
        if partner < size:
            comm.Sendrecv(work, dest=partner, recvbuf=scratch, source=partner)
            work += scratch
        distance *= 2
    return work


def rabenseifner_without_fold(comm, x):
    """Halving and doubling as if every rank count were a power of two."""
    rank, size = comm.Get_rank(), comm.Get_size()
    work = x.copy()
    bounds = block_bounds(work.size, size)
    low, high, distance = 0, size, size // 2
    while distance >= 1:
        partner, middle = rank ^ distance, low + distance
        keep, give = ((low, middle), (middle, high)) if rank < partner else ((middle, high), (low, middle))
        incoming = np.empty(bounds[keep[1]] - bounds[keep[0]], dtype=work.dtype)
        comm.Sendrecv(work[bounds[give[0]] : bounds[give[1]]].copy(), dest=partner, recvbuf=incoming, source=partner)
        work[bounds[keep[0]] : bounds[keep[1]]] += incoming
        (low, high), distance = keep, distance // 2
    distance = 1
    while distance < size:
        partner = rank ^ distance
        theirs = (low - distance, low) if rank > partner else (high, high + distance)
        incoming = np.empty(bounds[theirs[1]] - bounds[theirs[0]], dtype=work.dtype)
        comm.Sendrecv(work[bounds[low] : bounds[high]].copy(), dest=partner, recvbuf=incoming, source=partner)
        work[bounds[theirs[0]] : bounds[theirs[1]]] = incoming
        low, high, distance = min(low, theirs[0]), max(high, theirs[1]), distance * 2
    return work


def rabenseifner_of_whole_vectors(comm, x):
    """Recursive doubling handed in as Rabenseifner: right sum, whole vectors, half the messages."""
    return allreduce_recursive_doubling(comm, x)


def stub(comm, x):
    raise NotImplementedError("Exercise 3.2 (allreduce_ring) is not done yet")


WRONG = [
    (check_allreduce_ring, ring_not_a_ring, "to rank", 3),
    (check_allreduce_ring, ring_off_by_one, "wrong result", 2),
    (check_allreduce_ring, ring_of_whole_arrays, "2(P-1)", 2),
    (check_allreduce_ring, ring_in_place, "new array", 1),
    (check_allreduce_recursive_doubling, doubling_with_wrong_partner, "XOR", 4),
    (check_allreduce_recursive_doubling, doubling_without_fold, "wrong result", 3),
    (check_allreduce_rabenseifner, rabenseifner_without_fold, "P=3", 3),
    (check_allreduce_rabenseifner, rabenseifner_of_whole_vectors, "halving", 2),
]


@pytest.mark.parametrize("check, wrong, says, needs", WRONG, ids=[w[1].__name__ for w in WRONG])
def test_check_catches(check: Callable, wrong: Callable, says: str, needs: int) -> None:
    """Each mistake shows from `needs` ranks on (below that it is the right algorithm)."""
    if WORLD.size < needs:
        pytest.skip(f"{wrong.__name__} is only wrong on {needs} or more ranks")
    with pytest.raises(CheckFailed) as caught:
        check(wrong)
    assert says in str(caught.value)
    assert len(set(WORLD.allgather(str(caught.value)))) == 1, "every rank must report the same failure"


def test_a_deadlock_fails_instead_of_hanging() -> None:
    with pytest.raises(CheckFailed, match="never completed|failed"):
        check_allreduce_ring(ring_that_deadlocks, timeout=3.0)


@pytest.mark.parametrize(
    "check", [check_allreduce_recursive_doubling, check_allreduce_ring, check_allreduce_rabenseifner]
)
def test_a_stub_raises_not_implemented_on_every_rank(check: Callable) -> None:
    with pytest.raises(NotImplementedError, match="Exercise 3.2"):
        check(stub)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("allreduce_recursive_doubling", "ddlab.allreduce.allreduce_recursive_doubling", ()),
        ("allreduce_ring", "ddlab.allreduce.allreduce_ring", ()),
        ("allreduce_rabenseifner", "ddlab.allreduce.allreduce_rabenseifner", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)

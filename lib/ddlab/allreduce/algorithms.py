"""Allreduce built from point-to-point messages: the algorithms inside MPI and NCCL.

The reference versions of lab 03's exercises. Every function takes a communicator
(an mpi4py one, or a CountingComm) and a 1-D NumPy array `x` of the same length and
dtype on every rank; it returns a new array holding the elementwise sum over ranks
on every rank, and leaves `x` alone. Any number of ranks and any length work.

- naive: reduce to rank 0, then broadcast (lab 02's linear versions).
- tree: the same with binomial trees.
- recursive doubling: log2 P exchanges of the whole vector (MPICH's choice up to 2 KiB).
- ring: reduce-scatter then allgather around a ring, 2(P-1) steps of n/P items.
- Rabenseifner: reduce-scatter by recursive halving, allgather by recursive doubling.

The last two move 2(P-1)/P n items per rank, the lower bound. Recursive doubling and
Rabenseifner need a power of two; other rank counts fold the surplus ranks in first
and out at the end, as MPICH does (Thakur, Rabenseifner & Gropp, "Optimization of
collective communication operations in MPICH", 2005). Their costs are in
`ddlab.allreduce.cost`.

Before any message, the ranks compare lengths and dtypes in one small allgather, so
a mismatch raises the same ValueError everywhere instead of hanging or summing
garbage. It costs one latency; MPI_Allreduce trusts its caller instead.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..runtime.blocks import block_bounds
from ..runtime.comm import Comm
from ..runtime.counting import underlying

#: An allreduce as every lab plugs one in: (comm, x) -> a new array of the sums over ranks, x left alone.
#: The communicator is any `Comm`: an mpi4py one, or a CountingComm that counts what the allreduce sends.
Allreduce = Callable[[Comm, np.ndarray], np.ndarray]

#: The tag of every message these algorithms send.
TAG = 30
#: The tag of the ring's halves, reduce_scatter_ring and allgather_ring (lab 11's hierarchical allreduce
#: runs them beside allreduce_ring on sub-communicators).
RING_TAG = 31

_OK, _NOT_ARRAY, _NOT_1D, _NOT_NUMBERS = range(4)


_CODES: dict[np.dtype, int] = {}


def _dtype_code(dtype: np.dtype) -> int:
    """ord(kind) << 8 | itemsize for numbers in native byte order, 0 for anything else (cached)."""
    code = _CODES.get(dtype)
    if code is None:
        numbers = dtype.kind in "iufc" and dtype.isnative
        code = _CODES[dtype] = ord(dtype.kind) << 8 | dtype.itemsize if numbers else 0
    return code


def _describe(x: Any) -> array:
    """(status, length or ndim, dtype code) of this rank's input, for comparing across ranks."""
    if not isinstance(x, np.ndarray):
        return array("q", (_NOT_ARRAY, 0, 0))
    if x.ndim != 1:
        return array("q", (_NOT_1D, x.ndim, 0))
    code = _dtype_code(x.dtype)
    return array("q", (_OK, x.size, code) if code else (_NOT_NUMBERS, 0, 0))


def _dtype_name(code: int) -> str:
    return np.dtype(f"{chr(code >> 8)}{code & 255}").name


def _input_problem(rows: list[tuple[int, ...]]) -> str:
    """What is wrong with the inputs of the ranks, one row each, when they are not all alike and fine."""
    for rank, (status, value, _) in enumerate(rows):
        if status == _NOT_ARRAY:
            return f"rank {rank} passed something that is not a NumPy array: pass np.asarray(x)"
        if status == _NOT_1D:
            return f"rank {rank} passed a {value}-D array: pass a 1-D array (x.ravel())"
        if status == _NOT_NUMBERS:
            return (
                f"rank {rank} passed an array that does not hold numbers in native byte order: "
                "pass float32, float64, int64, ..."
            )
    have = ", ".join(f"rank {rank} has {value} {_dtype_name(code)}" for rank, (_, value, code) in enumerate(rows))
    return f"every rank must pass the same length and dtype, but {have}"


def agree_on_input(comm: Comm, x: Any) -> None:
    """Raise the same ValueError on every rank unless all pass 1-D arrays of one length and dtype.

    One Allgather of three numbers per rank, kept lean: it runs before every allreduce.
    """
    real = underlying(comm)
    mine, size = _describe(x), real.Get_size()
    table = array("q", bytes(mine.itemsize * len(mine) * size))
    real.Allgather(mine, table)
    if mine[0] != _OK or table.tobytes() != mine.tobytes() * size:
        rows = [tuple(table[3 * r : 3 * r + 3]) for r in range(size)]
        raise ValueError(f"allreduce: {_input_problem(rows)}")


def _start(comm: Comm, x: np.ndarray) -> np.ndarray:
    """Check the inputs agree, then return the work buffer: a private copy of x."""
    agree_on_input(comm, x)
    return np.array(x, copy=True)


# The fix-up for rank counts that are not a power of two --------------------------


def largest_power_of_two(size: int) -> int:
    """The largest power of two <= size."""
    return 1 << (size.bit_length() - 1)


def member_rank(group_rank: int, size: int) -> int:
    """The real rank of member `group_rank` of the power-of-two group (see fold_in)."""
    extra = size - largest_power_of_two(size)
    return 2 * group_rank + 1 if group_rank < extra else group_rank + extra


def fold_in(comm: Comm, work: np.ndarray, scratch: np.ndarray) -> int | None:
    """Shrink P ranks to a power of two, p', before recursive doubling or halving.

    With r = P - p' surplus ranks, the first 2r ranks pair up: each even one sends its
    vector to the odd one after it, which adds it into `work` and stays in the group;
    the even one sits out. Returns this rank's number in the group of p' ranks, or
    None if it sits out. `scratch` must hold as many items as `work`.
    """
    rank, extra = comm.Get_rank(), comm.Get_size() - largest_power_of_two(comm.Get_size())
    if rank >= 2 * extra:
        return rank - extra
    if rank % 2 == 0:
        comm.Send(work, dest=rank + 1, tag=TAG)
        return None
    comm.Recv(scratch, source=rank - 1, tag=TAG)
    np.add(work, scratch, out=work)
    return rank // 2


def fold_out(comm: Comm, work: np.ndarray, group_rank: int | None) -> None:
    """Undo fold_in: each odd rank among the first 2r sends the result to the even one before it."""
    rank, extra = comm.Get_rank(), comm.Get_size() - largest_power_of_two(comm.Get_size())
    if rank >= 2 * extra:
        return
    if group_rank is None:
        comm.Recv(work, source=rank + 1, tag=TAG)
    else:
        comm.Send(work, dest=rank - 1, tag=TAG)


# The algorithms -------------------------------------------------------------------


def allreduce_naive(comm: Comm, x: np.ndarray) -> np.ndarray:
    """Linear reduce to rank 0, then linear broadcast: 2(P-1) messages through rank 0."""
    from ..collectives import bcast_linear, reduce_linear

    agree_on_input(comm, x)
    total = reduce_linear(comm, x, root=0)
    return bcast_linear(comm, x if total is None else total, root=0)


def allreduce_tree(comm: Comm, x: np.ndarray) -> np.ndarray:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast: 2 ceil(log2 P) rounds."""
    from ..collectives import bcast_tree, reduce_tree

    agree_on_input(comm, x)
    total = reduce_tree(comm, x, root=0)
    return bcast_tree(comm, x if total is None else total, root=0)


def allreduce_recursive_doubling(comm: Comm, x: np.ndarray) -> np.ndarray:
    """In step k, swap whole vectors with the rank 2^k away and add: log2 P steps."""
    work = _start(comm, x)
    scratch = np.empty_like(work)
    group_rank = fold_in(comm, work, scratch)
    if group_rank is not None:
        distance, size = 1, comm.Get_size()
        while distance < largest_power_of_two(size):
            partner = member_rank(group_rank ^ distance, size)
            comm.Sendrecv(work, dest=partner, sendtag=TAG, recvbuf=scratch, source=partner, recvtag=TAG)
            np.add(work, scratch, out=work)
            distance *= 2
    fold_out(comm, work, group_rank)
    return work


def allreduce_ring(comm: Comm, x: np.ndarray) -> np.ndarray:
    """Reduce-scatter then allgather around a ring: 2(P-1) steps, each passing one chunk right.

    The vector is cut into P chunks (block_bounds). In reduce-scatter step s, rank r
    sends chunk r-s to rank r+1 and adds its own part of chunk r-s-1 to the partial sum
    arriving from rank r-1; after P-1 steps it holds the complete sum of chunk r+1. The
    allgather passes the complete chunks on around the ring, received straight into place.

    No copy of x is made: the first step sends x's own chunk, and every other chunk of
    the result is first written by a receive (each is received once in each phase), the
    add then working in place. That saves a pass over memory, which is what bounds long
    vectors on one machine.
    """
    agree_on_input(comm, x)
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return np.array(x, copy=True)
    mine = np.ascontiguousarray(x)
    work = np.empty_like(mine)
    bounds = block_bounds(work.size, size)
    own = [mine[bounds[c] : bounds[c + 1]] for c in range(size)]
    chunks = [work[bounds[c] : bounds[c + 1]] for c in range(size)]
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        outgoing = (own if step == 0 else chunks)[(rank - step) % size]
        arriving = (rank - step - 1) % size
        comm.Sendrecv(outgoing, dest=right, sendtag=TAG, recvbuf=chunks[arriving], source=left, recvtag=TAG)
        np.add(chunks[arriving], own[arriving], out=chunks[arriving])
    for step in range(size - 1):
        outgoing, incoming = chunks[(rank + 1 - step) % size], chunks[(rank - step) % size]
        comm.Sendrecv(outgoing, dest=right, sendtag=TAG, recvbuf=incoming, source=left, recvtag=TAG)
    return work


def reduce_scatter_ring(comm: Comm, x: np.ndarray, bounds: list[int]) -> np.ndarray:
    """Ring reduce-scatter: rank r returns the sum over ranks of x[bounds[r]:bounds[r+1]].

    No copy of x: the first step sends x's own chunk, and the partial sums travel in two
    chunk-sized buffers (a fresh full-size copy per call costs a pass over memory, and on a
    virtual machine the page faults of touching it first)."""
    rank, size = comm.Get_rank(), comm.Get_size()

    def chunk(c: int) -> np.ndarray:
        return x[bounds[c % size] : bounds[c % size + 1]]

    if size == 1:
        return chunk(0).copy()
    largest = max(bounds[c + 1] - bounds[c] for c in range(size))
    buffers = [np.empty(largest, dtype=x.dtype), np.empty(largest, dtype=x.dtype)]
    right, left = (rank + 1) % size, (rank - 1) % size
    sending = chunk(rank - 1)
    for step in range(size - 1):  # receive the left's partial sum of chunk rank-step-2, add mine, pass it on
        mine = chunk(rank - step - 2)
        arriving = buffers[step % 2][: mine.size]
        comm.Sendrecv(sending, dest=right, sendtag=RING_TAG, recvbuf=arriving, source=left, recvtag=RING_TAG)
        arriving += mine
        sending = arriving
    return sending


def allgather_ring(comm: Comm, mine: np.ndarray, bounds: list[int]) -> np.ndarray:
    """Ring allgather: every rank's piece (rank r's is bounds[r]:bounds[r+1]) into one new array."""
    rank, size = comm.Get_rank(), comm.Get_size()
    out = np.empty(bounds[-1], dtype=mine.dtype)
    chunks = [out[bounds[c] : bounds[c + 1]] for c in range(size)]
    chunks[rank][...] = mine
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        comm.Sendrecv(
            chunks[(rank - step) % size],
            dest=right,
            sendtag=RING_TAG,
            recvbuf=chunks[(rank - step - 1) % size],
            source=left,
            recvtag=RING_TAG,
        )
    return out


def allreduce_rabenseifner(comm: Comm, x: np.ndarray) -> np.ndarray:
    """Reduce-scatter by recursive halving, then allgather by recursive doubling.

    The vector is cut into p' blocks. Each halving step swaps half of the blocks this
    rank is still responsible for with the partner `distance` away (p'/2 first), keeping
    the half on its side; at the end group member i holds the complete sum of block i.
    The allgather retraces the steps backwards, doubling what each rank holds.
    """
    work = _start(comm, x)
    scratch = np.empty_like(work)
    group_rank = fold_in(comm, work, scratch)
    if group_rank is not None:
        size, pof2 = comm.Get_size(), largest_power_of_two(comm.Get_size())
        bounds = block_bounds(work.size, pof2)

        def span(first: int, last: int) -> np.ndarray:  # blocks first..last-1 of work
            return work[bounds[first] : bounds[last]]

        low, high, distance = 0, pof2, pof2 // 2
        while distance >= 1:
            partner, middle = group_rank ^ distance, low + distance
            keep, give = ((low, middle), (middle, high)) if group_rank < partner else ((middle, high), (low, middle))
            mine = span(*keep)
            incoming = scratch[: mine.size]
            peer = member_rank(partner, size)
            comm.Sendrecv(span(*give), dest=peer, sendtag=TAG, recvbuf=incoming, source=peer, recvtag=TAG)
            np.add(mine, incoming, out=mine)
            (low, high), distance = keep, distance // 2
        distance = 1
        while distance < pof2:
            partner = group_rank ^ distance
            theirs = (low - distance, low) if group_rank > partner else (high, high + distance)
            peer = member_rank(partner, size)
            comm.Sendrecv(span(low, high), dest=peer, sendtag=TAG, recvbuf=span(*theirs), source=peer, recvtag=TAG)
            low, high, distance = min(low, theirs[0]), max(high, theirs[1]), distance * 2
    fold_out(comm, work, group_rank)
    return work


def allreduce_mpi(comm: Comm, x: np.ndarray) -> np.ndarray:
    """The MPI library's own Allreduce (sum) into a new array, with the signature above."""
    out = np.empty_like(x)
    comm.Allreduce(x, out, op=MPI.SUM)
    return out


#: The hand-written algorithms by short name, in the order the lab introduces them.
ALGORITHMS = {
    "naive": allreduce_naive,
    "tree": allreduce_tree,
    "recursive_doubling": allreduce_recursive_doubling,
    "ring": allreduce_ring,
    "rabenseifner": allreduce_rabenseifner,
}

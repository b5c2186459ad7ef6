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
garbage. It costs one latency, as much as a small allreduce; MPI_Allreduce trusts its
caller instead. Recursive doubling, the small-message algorithm, carries the agreement
in its own messages instead (a 32-byte header ahead of the data), so it pays no
latency for it; on a CountingComm (a check's) it sends the textbook messages and
agrees on the side, uncounted.
"""

from __future__ import annotations

import functools
from array import array
from typing import Any, Callable, cast

import numpy as np
from mpi4py import MPI

from ..runtime.blocks import block_bounds
from ..runtime.comm import Comm
from ..runtime.counting import CountingComm, underlying

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


def _disagreement(comm: Comm, x: Any) -> str | None:
    """What is wrong with the ranks' inputs (the same text on every rank), or None: one Allgather of
    three numbers per rank on the real communicator (uncounted)."""
    real = underlying(comm)
    mine, size = _describe(x), real.Get_size()
    table = array("q", bytes(mine.itemsize * len(mine) * size))
    real.Allgather(mine, table)
    if mine[0] == _OK and table.tobytes() == mine.tobytes() * size:
        return None
    return _input_problem([tuple(table[3 * r : 3 * r + 3]) for r in range(size)])


def agree_on_input(comm: Comm, x: Any) -> None:
    """Raise the same ValueError on every rank unless all pass 1-D arrays of one length and dtype.

    One Allgather of three numbers per rank, kept lean: it runs before every allreduce
    but recursive doubling (which carries the agreement in its messages).
    """
    problem = _disagreement(comm, x)
    if problem is not None:
        raise ValueError(f"allreduce: {problem}")


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


# Recursive doubling: the agreement rides in its messages --------------------------

#: Bytes of the header ahead of the data in recursive doubling's messages on a real communicator:
#: four int64 (status, length or ndim, dtype code, and 1 while every rank heard from so far agrees).
#: 32 bytes keep the data behind it aligned for every dtype.
HEADER = 32


#: A frame (header and data) of up to this many bytes travels as one message; a longer one as its
#: header, then its data. Every first message therefore fits a receive buffer of this size, whatever
#: the sender's length: no receive can overflow, and none needs a probe first. (Recursive doubling
#: is the algorithm for short vectors: past 1 MiB the extra message per step costs little.)
SINGLE = 2**20
#: Frames up to this many bytes stay with an mpi4py communicator between calls (an MPI attribute,
#: freed with it, for the last length and dtype): a small call's Python work is most of its cost
#: (bench/allreduce.py --part breakdown). Larger ones get new buffers.
KEPT = 64 * 2**10


@functools.cache
def _kept_key() -> int:
    return MPI.Comm.Create_keyval()


def _data_bytes(header: memoryview) -> int:
    """Bytes of data behind a header: length x itemsize (the dtype code's low byte), 0 for bad input."""
    return int(header[1] * (header[2] & 255)) if header[0] == _OK else 0


class _Framed:
    """Recursive doubling's buffers on a real communicator: each message is a header, then the data.

    Every rank compares the header it receives with its own, and passes on whether all the ranks
    it has heard from (directly or through its partners) agree; after the last exchange every rank
    holds the same verdict, with no message of its own for the agreement.
    """

    def __init__(self, nbytes: int, dtype: np.dtype) -> None:
        self.frame = np.empty(HEADER + nbytes, dtype=np.uint8)  # what this rank sends
        self.incoming = np.empty(max(SINGLE, HEADER + nbytes), dtype=np.uint8)  # what it receives
        self.header = self.frame[:HEADER].data.cast("q")
        self.their_header = self.incoming[:HEADER].data.cast("q")
        self.work = self.frame[HEADER:].view(dtype)
        self.theirs = self.incoming[HEADER : HEADER + nbytes].view(dtype)
        self.split = self.frame.nbytes > SINGLE  # the data goes in a message of its own
        self.first = self.frame[:HEADER] if self.split else self.frame
        self.landing = self.incoming[:SINGLE]
        self.kept = False  # set when the buffers stay with a communicator

    @staticmethod
    def of(comm: Comm, x: Any) -> _Framed:
        """The buffers for x, this rank's header and a copy of x in place: kept on comm when small."""
        mine = _describe(x)
        data = x if mine[0] == _OK else np.empty(0, dtype=np.uint8)
        keeper = comm if isinstance(comm, MPI.Comm) and HEADER + data.nbytes <= KEPT else None
        framed = cast("_Framed | None", keeper.Get_attr(_kept_key())) if keeper is not None else None
        if framed is None or framed.work.size != data.size or framed.work.dtype != data.dtype:
            framed = _Framed(data.nbytes, data.dtype)
            if keeper is not None:  # one call at a time per communicator uses them, as MPI's matching needs anyway
                keeper.Set_attr(_kept_key(), framed)
                framed.kept = True
        framed.header[0], framed.header[1], framed.header[2], framed.header[3] = mine[0], mine[1], mine[2], 1
        framed.work[...] = data
        return framed

    def _data_into(self, into: np.ndarray) -> np.ndarray:
        """Where the data that follows the header just received goes: `into` if it has that size, else scratch."""
        nbytes = _data_bytes(self.their_header)
        return into.view(np.uint8) if nbytes == into.nbytes else np.empty(nbytes, dtype=np.uint8)

    def _follows(self) -> bool:
        """Whether the header just received comes without its data (which follows as a message of its own)."""
        return HEADER + _data_bytes(self.their_header) > SINGLE

    def _merge(self) -> bool:
        """Fold the received header's verdict into this rank's; True if the data may be added."""
        agree = self.header[3] == 1 and self.header.tolist() == self.their_header.tolist()
        self.header[3] = int(agree)
        return agree

    def swap(self, comm: Comm, peer: int) -> None:
        """Exchange with peer, then add its vector to this rank's (if all agree so far)."""
        comm.Sendrecv(self.first, dest=peer, sendtag=TAG, recvbuf=self.landing, source=peer, recvtag=TAG)
        if self.split and self._follows():
            into = self._data_into(self.theirs)
            comm.Sendrecv(self.work, dest=peer, sendtag=TAG, recvbuf=into, source=peer, recvtag=TAG)
        elif self.split:
            comm.Send(self.work, dest=peer, tag=TAG)
        elif self._follows():
            comm.Recv(self._data_into(self.theirs), source=peer, tag=TAG)
        if self._merge():
            np.add(self.work, self.theirs, out=self.work)

    def give(self, comm: Comm, peer: int) -> None:
        comm.Send(self.first, dest=peer, tag=TAG)
        if self.split:
            comm.Send(self.work, dest=peer, tag=TAG)

    def take_sum(self, comm: Comm, peer: int) -> None:
        """Receive peer's vector (fold in) and add it to this rank's."""
        comm.Recv(self.landing, source=peer, tag=TAG)
        if self._follows():
            comm.Recv(self._data_into(self.theirs), source=peer, tag=TAG)
        if self._merge():
            np.add(self.work, self.theirs, out=self.work)

    def take_result(self, comm: Comm, peer: int) -> None:
        """Receive the result (fold out) in place of this rank's vector, and the verdict with it."""
        comm.Recv(self.landing, source=peer, tag=TAG)
        if self._follows():
            comm.Recv(self._data_into(self.work), source=peer, tag=TAG)
        if self._merge() and not self.split:
            self.work[...] = self.theirs

    def result(self, comm: Comm, x: Any) -> np.ndarray:
        """The sum, once every rank knows all agreed; else the same ValueError on every rank."""
        if self.header[3] == 1 and self.header[0] == _OK:
            return self.work.copy() if self.kept else self.work  # kept buffers stay with the communicator
        problem = _disagreement(comm, x)  # every rank is here with the same verdict: gather the inputs
        raise ValueError(f"allreduce: {problem or 'the ranks passed different inputs'}")


class _Counted:
    """Recursive doubling's buffers on a CountingComm (a check's): the textbook messages, the data alone,
    after agreeing on the side with agree_on_input (uncounted), so the count is the algorithm's."""

    def __init__(self, comm: Comm, x: np.ndarray) -> None:
        self.work = _start(comm, x)
        self.scratch = np.empty_like(self.work)

    def swap(self, comm: Comm, peer: int) -> None:
        comm.Sendrecv(self.work, dest=peer, sendtag=TAG, recvbuf=self.scratch, source=peer, recvtag=TAG)
        np.add(self.work, self.scratch, out=self.work)

    def give(self, comm: Comm, peer: int) -> None:
        comm.Send(self.work, dest=peer, tag=TAG)

    def take_sum(self, comm: Comm, peer: int) -> None:
        comm.Recv(self.scratch, source=peer, tag=TAG)
        np.add(self.work, self.scratch, out=self.work)

    def take_result(self, comm: Comm, peer: int) -> None:
        comm.Recv(self.work, source=peer, tag=TAG)

    def result(self, comm: Comm, x: Any) -> np.ndarray:
        return self.work


def allreduce_recursive_doubling(comm: Comm, x: np.ndarray) -> np.ndarray:
    """In step k, swap whole vectors with the rank 2^k away and add: log2 P steps.

    Other rank counts fold in first and out at the end (as fold_in and fold_out). On a real
    communicator the agreement on length and dtype rides in the messages (`_Framed`): no
    collective of its own, which at small sizes would cost as much as the allreduce.
    """
    buffers = _Counted(comm, x) if isinstance(comm, CountingComm) else _Framed.of(comm, x)
    rank, size = comm.Get_rank(), comm.Get_size()
    pof2 = largest_power_of_two(size)
    extra = size - pof2
    if rank < 2 * extra and rank % 2 == 0:  # sits out: its vector in, the result back
        buffers.give(comm, rank + 1)
        buffers.take_result(comm, rank + 1)
        return buffers.result(comm, x)
    if rank < 2 * extra:
        buffers.take_sum(comm, rank - 1)
    group_rank = rank // 2 if rank < 2 * extra else rank - extra
    distance = 1
    while distance < pof2:
        buffers.swap(comm, member_rank(group_rank ^ distance, size))
        distance *= 2
    if rank < 2 * extra:
        buffers.give(comm, rank - 1)
    return buffers.result(comm, x)


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

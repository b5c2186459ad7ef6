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
in its own messages instead (each message's tag names its dtype and its size is the
length), so it pays no latency for it; on a CountingComm (a check's) it sends the
textbook messages and agrees on the side, uncounted.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..runtime.blocks import block_bounds
from ..runtime.comm import Comm
from ..runtime.counting import underlying
from ..runtime.reference import reference

#: An allreduce as every lab plugs one in: (comm, x) -> a new array of the sums over ranks, x left alone.
#: The communicator is any `Comm`: an mpi4py one, or a CountingComm that counts what the allreduce sends.
Allreduce = Callable[[Comm, np.ndarray], np.ndarray]

#: The tag of every message these algorithms send.
TAG = 30
#: The tag of the ring's halves, reduce_scatter_ring and allgather_ring (lab 11's hierarchical allreduce
#: runs them beside allreduce_ring on sub-communicators).
RING_TAG = 31

_OK, _NOT_ARRAY, _NOT_1D, _NOT_NUMBERS = range(4)


_NUMBERS: dict[np.dtype, int] = {}
_KINDS = "iufc"


def _dtype_number(dtype: np.dtype) -> int:
    """1-30 for numbers in native byte order (their kind << 3 | bit length of their itemsize), 0 for
    anything else (cached). Small enough for a tag's bits (see FOLLOWS)."""
    number = _NUMBERS.get(dtype)
    if number is None:
        numbers = dtype.kind in _KINDS and dtype.isnative
        number = _NUMBERS[dtype] = _KINDS.index(dtype.kind) << 3 | dtype.itemsize.bit_length() if numbers else 0
    return number


def _describe(x: Any) -> array:
    """(status, length or ndim, dtype number) of this rank's input, for comparing across ranks."""
    if not isinstance(x, np.ndarray):
        return array("q", (_NOT_ARRAY, 0, 0))
    if x.ndim != 1:
        return array("q", (_NOT_1D, x.ndim, 0))
    number = _dtype_number(x.dtype)
    return array("q", (_OK, x.size, number) if number else (_NOT_NUMBERS, 0, 0))


def _dtype_name(number: int) -> str:
    return np.dtype(f"{_KINDS[number >> 3]}{1 << (number & 7) - 1}").name


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
    have = ", ".join(f"rank {rank} has {value} {_dtype_name(number)}" for rank, (_, value, number) in enumerate(rows))
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


@reference("trains_with_allreduce")
def allreduce_naive(comm: Comm, x: np.ndarray) -> np.ndarray:
    """Linear reduce to rank 0, then linear broadcast: 2(P-1) messages through rank 0."""
    from ..collectives import bcast_linear, reduce_linear

    agree_on_input(comm, x)
    total = reduce_linear(comm, x, root=0)
    return bcast_linear(comm, x if total is None else total, root=0)


@reference("trains_with_allreduce")
def allreduce_tree(comm: Comm, x: np.ndarray) -> np.ndarray:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast: 2 ceil(log2 P) rounds."""
    from ..collectives import bcast_tree, reduce_tree

    agree_on_input(comm, x)
    total = reduce_tree(comm, x, root=0)
    return bcast_tree(comm, x if total is None else total, root=0)


# Recursive doubling: the agreement rides in its messages' envelopes ----------------

#: A vector of up to this many bytes travels whole; a longer one is announced first (one int64: its size in
#: bytes), then sent. Every first message from a peer therefore fits the landing buffer each rank keeps: no
#: receive can overflow, whatever the peer passed, and none needs a probe first. (Recursive doubling is the
#: algorithm for short vectors: past 1 MiB the extra message per step costs little.)
SINGLE = 2**20

#: Bits of recursive doubling's tags on a real communicator. A message's tag says what its sender passed, so
#: the receiver compares it with its own input at no cost in bytes or messages: the dtype's number
#: (`_dtype_number`, 0 for input that is not a 1-D array of numbers) << 2, | FOLLOWS if the data comes in a
#: message of its own after an announcement, | AGREED while the input of every rank the sender has heard from
#: (directly or through its partners) matches its own. The length is the message's size, or the announced one.
FOLLOWS, AGREED = 2, 1


def doubling_steps(rank: int, size: int) -> list[tuple[str, int]]:
    """Recursive doubling's messages for this rank, in order: ("send" | "recv" | "swap", peer).

    Rank counts that are not a power of two fold in first and out at the end (as fold_in and fold_out):
    a rank that sits out sends its vector, then receives the result."""
    pof2 = largest_power_of_two(size)
    extra = size - pof2
    if rank < 2 * extra and rank % 2 == 0:
        return [("send", rank + 1), ("recv", rank + 1)]
    group = rank // 2 if rank < 2 * extra else rank - extra
    steps = [("recv", rank - 1)] if rank < 2 * extra else []
    distance = 1
    while distance < pof2:
        steps.append(("swap", member_rank(group ^ distance, size)))
        distance *= 2
    return steps + ([("send", rank - 1)] if rank < 2 * extra else [])


def _doubling_textbook(comm: Comm, x: np.ndarray) -> np.ndarray:
    """On a CountingComm (a check's), or any communicator that is not mpi4py's: the textbook messages, the
    data alone, after agreeing on the side with agree_on_input (uncounted), so the count is the algorithm's."""
    work = _start(comm, x)
    scratch = np.empty_like(work)
    steps = doubling_steps(comm.Get_rank(), comm.Get_size())
    for kind, peer in steps:
        if kind == "send":
            comm.Send(work, dest=peer, tag=TAG)
        elif kind == "swap":
            comm.Sendrecv(work, dest=peer, sendtag=TAG, recvbuf=scratch, source=peer, recvtag=TAG)
            np.add(work, scratch, out=work)
        elif steps[0][0] == "send":  # sat out: the result
            comm.Recv(work, source=peer, tag=TAG)
        else:
            comm.Recv(scratch, source=peer, tag=TAG)
            np.add(work, scratch, out=work)
    return work


#: What recursive doubling keeps per mpi4py communicator, by its handle. An MPI attribute on the communicator
#: removes the entry (and frees the private duplicate) when the communicator is freed, so a handle MPI hands
#: out again never finds a stale entry. (The dict finds it in a tenth of MPI_Comm_get_attr's time, which
#: counts at 800 bytes: bench/allreduce.py --part breakdown.)
_KEPT: dict[int, _Doubling] = {}


def _forget_doubling(comm: MPI.Comm, key: int, handle: int) -> None:
    _KEPT.pop(handle).comm.Free()


_FORGET = MPI.Comm.Create_keyval(delete_fn=_forget_doubling)
_ANY_TAG, _BYTE = MPI.ANY_TAG, MPI.BYTE


class _Doubling:
    """What recursive doubling keeps with an mpi4py communicator between calls: a private duplicate, on which a
    receive from any tag can only match these messages; this rank's steps; the landing buffer for whatever a
    peer sends first; one status. A small call's Python work is most of its cost (every microsecond of it
    also waits for a core when ranks outnumber cores), so a call does little beyond its messages."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm.Dup()  # every rank's first call on comm: a collective, as the allreduce is
        self.steps = doubling_steps(comm.Get_rank(), comm.Get_size())
        self.sits_out = bool(self.steps) and self.steps[0][0] == "send"
        self.partners = [peer for _, peer in self.steps] if all(k == "swap" for k, _ in self.steps) else []
        self.landing = np.empty(SINGLE, dtype=np.uint8)
        self.status = MPI.Status()
        self.followed = self.landing  # the data of a message that came after its announcement
        #: The last valid input's (dtype, shape, bytes, tag, landing view), when the next call of its kind may go
        #: the short way (a power of two of ranks, a whole message).
        self.last: tuple[np.dtype | None, tuple[int, ...], int, int, np.ndarray] = (None, (), 0, 0, self.landing[:0])

    @staticmethod
    def keep(comm: MPI.Comm) -> _Doubling:
        """A new _Doubling for comm, kept until comm is freed."""
        kept = _KEPT[comm.handle] = _Doubling(comm)
        comm.Set_attr(_FORGET, comm.handle)
        return kept

    @reference("allreduce_recursive_doubling", "trains_with_allreduce")
    def allreduce(self, comm: MPI.Comm, x: Any) -> np.ndarray:
        dtype, shape, nbytes, tag, arrived = self.last
        if x.__class__ is not np.ndarray or x.dtype is not dtype or x.shape != shape or not x.flags.c_contiguous:
            return self.first_of_its_kind(comm, x)
        work, private, landing, status = None, self.comm, self.landing, self.status
        for peer in self.partners:  # a power of two of ranks, whole messages, the input of the last call's kind
            private.Sendrecv(x if work is None else work, peer, tag, landing, peer, _ANY_TAG, status)
            if status.Get_tag() != tag or status.Get_count(_BYTE) != nbytes:
                if status.Get_tag() & FOLLOWS:
                    self.rest(peer, status.Get_tag())
                tag &= ~AGREED  # passed on: every rank ends with the same verdict
            elif work is None:
                work = x + arrived  # the result: a new array
            else:
                work += arrived
        return work if tag & AGREED and work is not None else self.refuse(comm, x)

    def first_of_its_kind(self, comm: MPI.Comm, x: Any) -> np.ndarray:
        """Any input, rank count and length (folds in and out, announced messages); a valid input of a power of
        two of ranks that travels whole becomes the kind the next calls take the short way."""
        number = _dtype_number(x.dtype) if isinstance(x, np.ndarray) and x.ndim == 1 else 0
        data = np.ascontiguousarray(x) if number else np.empty(0, dtype=np.uint8)
        tag = number << 2 | (FOLLOWS if data.nbytes > SINGLE else 0) | (AGREED if number else 0)
        arrived = self.landing[: data.nbytes].view(data.dtype)  # where a peer's whole message lands
        work, tag = self.any_steps(data, tag, arrived)
        if not tag & AGREED:
            return self.refuse(comm, x)
        if self.partners and not tag & FOLLOWS:
            self.last = (data.dtype, data.shape, data.nbytes, tag, arrived)
        return data.copy() if work is None else work

    def refuse(self, comm: MPI.Comm, x: Any) -> np.ndarray:
        """Every rank is here with the same verdict: gather the inputs and say which rank differs."""
        problem = _disagreement(comm, x)
        raise ValueError(f"allreduce: {problem or 'the ranks passed different inputs'}")

    def any_steps(self, data: np.ndarray, tag: int, arrived: np.ndarray) -> tuple[np.ndarray | None, int]:
        """Any rank count and length: folds in and out, announced messages. Returns the sum and the tag."""
        work, nbytes = None, data.nbytes
        for kind, peer in self.steps:
            their_tag, their_bytes = self.step(kind, peer, data if work is None else work, tag)
            if kind == "send":
                continue
            if their_tag != tag or their_bytes != nbytes or not tag & AGREED:
                tag &= ~AGREED
                continue
            theirs = self.followed.view(data.dtype) if tag & FOLLOWS else arrived
            if self.sits_out:
                work = theirs.copy()
            elif work is None:
                work = np.add(data, theirs)
            else:
                np.add(work, theirs, out=work)
        return work, tag

    def step(self, kind: str, peer: int, outgoing: np.ndarray, tag: int) -> tuple[int, int]:
        """One step's messages with peer. Returns the tag and bytes of what arrived ((0, 0) after a send): its
        data is in the landing buffer, or in `followed` if it came after an announcement."""
        comm, status, follows = self.comm, self.status, tag & FOLLOWS
        first = np.array([outgoing.nbytes], dtype=np.int64) if follows else outgoing
        if kind == "send":
            comm.Send(first, dest=peer, tag=tag)
            if follows:
                comm.Send(outgoing, dest=peer, tag=tag)
            return 0, 0
        if kind == "swap":
            comm.Sendrecv(first, peer, tag, self.landing, peer, _ANY_TAG, status)
        else:
            comm.Recv(self.landing, peer, _ANY_TAG, status)
        their_tag = status.Get_tag()
        if not their_tag & FOLLOWS:
            if kind == "swap" and follows:
                comm.Send(outgoing, dest=peer, tag=tag)
            return their_tag, status.Get_count(_BYTE)
        if kind == "swap" and follows:
            return their_tag, self.rest(peer, their_tag, outgoing, tag)
        return their_tag, self.rest(peer, their_tag)

    def rest(self, peer: int, their_tag: int, outgoing: np.ndarray | None = None, tag: int = 0) -> int:
        """Receive the data peer announced into `followed`, and send `outgoing` (announced too) at once if given."""
        their_bytes = int(self.landing[:8].view(np.int64)[0])
        self.followed = np.empty(their_bytes, dtype=np.uint8)
        if outgoing is None:
            self.comm.Recv(self.followed, peer, their_tag)
        else:
            self.comm.Sendrecv(outgoing, peer, tag, self.followed, peer, their_tag)
        return their_bytes


@reference("allreduce_recursive_doubling", "trains_with_allreduce")
def allreduce_recursive_doubling(comm: Comm, x: np.ndarray) -> np.ndarray:
    """In step k, swap whole vectors with the rank 2^k away and add: log2 P steps.

    Other rank counts fold in first and out at the end (`doubling_steps`). On a real communicator the
    agreement on length and dtype rides in the messages' tags and sizes (`_Doubling`): no collective and no
    byte of its own, which at small sizes would cost as much as the allreduce.
    """
    if isinstance(comm, MPI.Comm):
        return (_KEPT.get(comm.handle) or _Doubling.keep(comm)).allreduce(comm, x)
    return _doubling_textbook(comm, x)


@reference("allreduce_ring", "trains_with_allreduce")
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


@reference("allreduce_ring", "reduce_scatter")
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


@reference("allreduce_ring", "allgather")
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


@reference("allreduce_rabenseifner", "trains_with_allreduce")
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

"""Broadcast and reduce built from point-to-point messages: linear and binomial tree.

The reference versions of lab 02's exercises. Every function takes a communicator
(an mpi4py one, or a CountingComm), a NumPy array `x` of the same shape and dtype on
every rank, and a root; it returns a new array and leaves `x` alone. Broadcasts give
every rank the root's values; reductions give the root the elementwise sum and every
other rank None. Lab 03 builds its naive allreduce from them (reduce, then broadcast).

The trees are the binomial trees of MPICH (Thakur, Rabenseifner & Gropp, "Optimization
of collective communication operations in MPICH", 2005): ranks are renumbered so the
root is 0, and in round k every rank that has the data sends it 2^k ranks further,
so P ranks need ceil(log2 P) rounds instead of the linear version's P-1.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..runtime.comm import Comm
from ..runtime.reference import reference

#: The tag of every message these collectives send.
TAG = 20


def _buffer(x: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of x: MPI moves bytes as they lie, so both sides agree on one layout."""
    return np.array(x, order="C", copy=True)


@reference("bcast_linear")
def bcast_linear(comm: Comm, x: np.ndarray, root: int = 0) -> np.ndarray:
    """The root sends x to every other rank in turn: P-1 messages, P-1 rounds."""
    rank, size = comm.Get_rank(), comm.Get_size()
    out = _buffer(x)
    if rank == root:
        for dest in range(size):
            if dest != root:
                comm.Send(out, dest=dest, tag=TAG)
    else:
        comm.Recv(out, source=root, tag=TAG)
    return out


@reference("bcast_tree")
def bcast_tree(comm: Comm, x: np.ndarray, root: int = 0) -> np.ndarray:
    """Binomial tree: each rank receives once from its parent, then forwards to its children."""
    rank, size = comm.Get_rank(), comm.Get_size()
    me = (rank - root) % size  # rank relative to the root
    out = _buffer(x)
    mask = 1
    while mask < size:  # the lowest set bit of `me` names the parent: me - mask
        if me & mask:
            comm.Recv(out, source=(me - mask + root) % size, tag=TAG)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # children me + mask for every lower bit, farthest first
        if me + mask < size:
            comm.Send(out, dest=(me + mask + root) % size, tag=TAG)
        mask >>= 1
    return out


@reference("reduce_linear")
def reduce_linear(comm: Comm, x: np.ndarray, root: int = 0) -> np.ndarray | None:
    """Every other rank sends x to the root, which adds them up: P-1 messages, all into the root."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank != root:
        comm.Send(_buffer(x), dest=root, tag=TAG)
        return None
    total, incoming = _buffer(x), np.empty(x.shape, x.dtype)
    for source in range(size):
        if source != root:
            comm.Recv(incoming, source=source, tag=TAG)
            total += incoming
    return total


@reference("reduce_tree")
def reduce_tree(comm: Comm, x: np.ndarray, root: int = 0) -> np.ndarray | None:
    """Binomial tree run backwards: add the children's partial sums, then send to the parent."""
    rank, size = comm.Get_rank(), comm.Get_size()
    me = (rank - root) % size
    total, incoming = _buffer(x), np.empty(x.shape, x.dtype)
    mask = 1
    while mask < size:
        if me & mask:
            comm.Send(total, dest=(me - mask + root) % size, tag=TAG)
            return None
        if me + mask < size:
            comm.Recv(incoming, source=(me + mask + root) % size, tag=TAG)
            total += incoming
        mask <<= 1
    return total


def bcast_mpi(comm: MPI.Comm, x: np.ndarray, root: int = 0) -> np.ndarray:
    """The MPI library's own Bcast, with the signature of the functions above."""
    out = _buffer(x)
    comm.Bcast(out, root=root)
    return out


def reduce_mpi(comm: MPI.Comm, x: np.ndarray, root: int = 0) -> np.ndarray | None:
    """The MPI library's own Reduce (sum), with the signature of the functions above."""
    out = np.empty(x.shape, x.dtype) if comm.Get_rank() == root else None
    comm.Reduce(_buffer(x), out, op=MPI.SUM, root=root)
    return out

"""DeepSpeed-Ulysses (Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models", 2023): the other way to split attention over a sequence.

Each rank holds n rows of every one of H heads, q, k, v of shape (H, n, d). One all-to-all per
tensor swaps the sequence split for a head split: rank r sends its rows of heads
d H/P .. (d+1) H/P - 1 to rank d, and receives every rank's rows of its own H/P heads, so it holds
the whole sequence (P n rows, in rank order) for H/P heads, and attends over it on its own, with
the causal mask by the rows' global positions. One more all-to-all takes the output back to the
sequence split. H must be a multiple of P. Bytes sent per rank: 4 H n d b (P-1)/P (q, k and v out,
the output back), against ring attention's 2 (P-1) H n d b forward; what arrives is (P-1)/P of a
whole sequence's q, k, v for H/P heads, against ring attention's one key/value block at a time.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..runtime.reference import reference
from .blockwise import reference_attention


@reference("ulysses")
def heads_to_ranks(comm: MPI.Comm, x: np.ndarray) -> np.ndarray:
    """(H, n, d), n rows of every head -> (H/P, P n, d), every rank's rows of this rank's heads: one Alltoall."""
    size = comm.Get_size()
    heads, rows, width = x.shape
    if heads % size:
        raise ValueError(f"{heads} heads cannot be shared by {size} ranks: use a multiple of {size} heads")
    outgoing = np.ascontiguousarray(x.reshape(size, heads // size, rows, width))  # block d: rank d's heads
    incoming = np.empty_like(outgoing)  # block s: rank s's rows of my heads
    comm.Alltoall(outgoing, incoming)
    return np.concatenate(list(incoming), axis=-2)


@reference("ulysses")
def ranks_to_heads(comm: MPI.Comm, y: np.ndarray) -> np.ndarray:
    """The inverse of heads_to_ranks: (H/P, P n, d) -> (H, n, d), this rank's rows of every head."""
    size = comm.Get_size()
    local, length, width = y.shape
    rows = length // size
    outgoing = np.ascontiguousarray(np.stack(np.split(y, size, axis=-2)))  # block s: rank s's rows
    incoming = np.empty_like(outgoing)  # block d: my rows of rank d's heads
    comm.Alltoall(outgoing, incoming)
    return incoming.reshape(size * local, rows, width)


@reference("ulysses")
def ulysses_attention(comm: MPI.Comm, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Causal attention of this rank's rows (H, n, d) over every rank's, by a head split: this rank's output.

    positions: the (P, n) array of every rank's global positions (the same on every rank)."""
    whole = np.asarray(positions).reshape(-1)  # the rows' positions after the all-to-all, in rank order
    q_heads, k_heads, v_heads = (heads_to_ranks(comm, t) for t in (q, k, v))
    out, _ = reference_attention(q_heads, k_heads, v_heads, whole, whole)
    return ranks_to_heads(comm, out)

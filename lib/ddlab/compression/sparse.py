"""Allreduce of sparse gradients: every rank's (index, value) pairs through Allgatherv.

The sum of sparse vectors fills in: rank 3's top entries are not where rank 1's are, so
their sum holds both sets of positions. A ring could cut the positions into P chunks,
but the partial sums its reduce-scatter passes on would grow at every step towards
dense ones, so the dense ring's bandwidth bound (messages of one size) does not carry
over. Instead each rank gets every other rank's pairs: Allgatherv, then each rank adds
the P sparse vectors into a dense one. The bytes grow with P, where the ring's stay at
2(P-1)/P n.

Exercise signature (lab 11):
`sparse_allreduce(comm, indices, values, n)`: `indices` a 1-D int32 array of distinct
positions in 0..n-1 and `values` a 1-D float array of the same length (lengths may
differ between ranks); returns a new dense array of n items, the dtype of `values`,
holding the sum over ranks of the sparse vectors. First agree on the counts (one
Allgather of an int per rank), then one Allgatherv of the indices and one of the values.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from ..allreduce.cost import Link, Terms, collective_terms, terms
from ..runtime.comm import Comm
from ..runtime.reference import reference
from .compressors import INDEX


@reference("sparse_allreduce")
def sparse_allreduce(comm: Comm, indices: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Sum over ranks of the sparse vectors (indices, values) of length n, as a dense array."""
    if indices.shape != values.shape or indices.ndim != 1:
        raise ValueError(f"indices and values must be 1-D of one length, got {indices.shape} and {values.shape}")
    counts = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([indices.size], dtype=np.int64), counts)
    displacements = np.concatenate(([0], np.cumsum(counts)[:-1]))
    every_index = np.empty(int(counts.sum()), dtype=INDEX)
    every_value = np.empty(int(counts.sum()), dtype=values.dtype)
    comm.Allgatherv(np.ascontiguousarray(indices, dtype=INDEX), [every_index, counts, displacements, MPI.INT32_T])
    comm.Allgatherv(np.ascontiguousarray(values), [every_value, counts, displacements, from_numpy_dtype(values.dtype)])
    total = np.zeros(n, dtype=values.dtype)
    np.add.at(total, every_index, every_value)
    return total


def allgather_bytes_per_rank(contributions: float | np.ndarray, size: int) -> float | np.ndarray:
    """Bytes each rank sends, on average, in a ring allgather of `size` contributions of that many bytes.

    Rank r forwards every block but its right neighbour's: (P-1) contributions.
    """
    return collective_terms("allgather", size, size * np.asarray(contributions, dtype=float), "ring").bytes


def sparse_bytes_per_rank(n: int, density: float, size: int, value_bytes: int = 4) -> float:
    """Bytes per rank of the sparse allreduce: (P-1) k (index + value) bytes, k = density n."""
    return float(allgather_bytes_per_rank(density * n * (np.dtype(INDEX).itemsize + value_bytes), size))


def dense_ring_bytes_per_rank(n: int, size: int, value_bytes: int = 4) -> float:
    """Bytes per rank of the dense ring allreduce: 2(P-1)/P n values."""
    return float(terms("ring", size, n * value_bytes).bytes)


def sparse_seconds(n: int, density: float, size: int, link: Link, value_bytes: int = 4) -> float:
    """Predicted time of the sparse allreduce: a count allgather and two ring Allgathervs, then P adds."""
    messages = 3 * (size - 1)
    added = size * density * n * value_bytes
    return float(Terms(messages, sparse_bytes_per_rank(n, density, size, value_bytes), added).seconds(link))


def crossover_density(n: int, size: int, link: Link, value_bytes: int = 4) -> float:
    """The density above which the dense ring is predicted faster than the sparse allreduce (1 if never).

    Both times are linear in the density, so bisect-free: solve sparse(d) = ring.
    """
    ring = float(terms("ring", size, n * value_bytes).seconds(link))
    at_zero = sparse_seconds(n, 0.0, size, link, value_bytes)
    slope = sparse_seconds(n, 1.0, size, link, value_bytes) - at_zero
    if at_zero >= ring:
        return 0.0
    return min(1.0, (ring - at_zero) / slope)


def bandwidth_crossover_density(size: int, value_bytes: int = 4) -> float:
    """The density where the bytes are equal: (P-1) d (i + v) = 2 (P-1)/P v, so d = 2v / (P (i + v))."""
    return 2 * value_bytes / (size * (np.dtype(INDEX).itemsize + value_bytes))

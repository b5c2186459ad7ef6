"""The two halves of lab 03's ring, as sharded data parallelism uses them, pluggable.

A ring allreduce is a reduce-scatter followed by an allgather. Sharded data
parallelism calls the halves apart: gradients are reduce-scattered (each rank keeps
the sum of its own shard), parameters allgathered (every rank gets every shard).
Any pair of functions with these signatures plugs in:

    reduce_scatter(comm, x, bounds) -> a new array: the sum over ranks of x[bounds[r]:bounds[r+1]] on rank r
    allgather(comm, mine, bounds)   -> a new array of bounds[-1] items: rank q's `mine` at bounds[q]:bounds[q+1]

`x` is a 1-D array of bounds[-1] items, the same length and dtype on every rank;
`bounds` has P + 1 entries. Choices: "ring" (lab 03's ring halves, point-to-point
messages, so a counting communicator counts them), "mpi" (the MPI library's
Reduce_scatter and Allgatherv), or a function of your own. A function must return a
new array each call: the caller keeps it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from mpi4py import MPI

from ..allreduce import allgather_ring, reduce_scatter_ring
from ..runtime.comm import Comm
from ..runtime.counting import underlying

ReduceScatter = Callable[[Comm, np.ndarray, list[int]], np.ndarray]
Allgather = Callable[[Comm, np.ndarray, list[int]], np.ndarray]
#: What callers may pass: "ring", "mpi", or a (reduce_scatter, allgather) pair of functions.
CollectivesChoice = str | tuple[ReduceScatter, Allgather]


def reduce_scatter_mpi(comm: Comm, x: np.ndarray, bounds: list[int]) -> np.ndarray:
    """MPI's Reduce_scatter (sum), with the signature above."""
    counts = np.diff(bounds).tolist()
    out = np.empty(counts[comm.Get_rank()], dtype=x.dtype)
    underlying(comm).Reduce_scatter(np.ascontiguousarray(x), out, recvcounts=counts, op=MPI.SUM)
    return out


def allgather_mpi(comm: Comm, mine: np.ndarray, bounds: list[int]) -> np.ndarray:
    """MPI's Allgatherv, with the signature above."""
    out = np.empty(bounds[-1], dtype=mine.dtype)
    underlying(comm).Allgatherv(np.ascontiguousarray(mine), [out, np.diff(bounds).tolist()])
    return out


CHOICES: dict[str, tuple[ReduceScatter, Allgather]] = {
    "ring": (reduce_scatter_ring, allgather_ring),
    "mpi": (reduce_scatter_mpi, allgather_mpi),
}


def resolve_collectives(choice: CollectivesChoice) -> tuple[ReduceScatter, Allgather]:
    """The (reduce_scatter, allgather) pair for a name or a pair of functions."""
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ValueError(
                f"no collectives called {choice!r}: use one of {sorted(CHOICES)} or pass a pair "
                "(reduce_scatter(comm, x, bounds), allgather(comm, mine, bounds))"
            )
        return CHOICES[choice]
    if not (isinstance(choice, tuple) and len(choice) == 2 and all(callable(f) for f in choice)):
        raise TypeError(
            "collectives must be 'ring', 'mpi' or a pair of functions "
            f"(reduce_scatter(comm, x, bounds), allgather(comm, mine, bounds)), got {choice!r}"
        )
    return choice

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
reduce-scatter and allgather), or a function of your own. A function must return a
new array each call: the caller keeps it.

`Collectives` starts them: "mpi" as MPI's non-blocking `Ireduce_scatter_block` and
`Iallgather` (the flat space's shards are equal), so they move while torch computes,
as long as the caller lets MPI progress them (`InFlight.done`, between units); a
function (the ring, yours) runs to its end when started, so it overlaps nothing. On a
`CountingComm` "mpi" runs as the counting communicator's blocking Reduce_scatter and
Allgatherv (counted like lab 03's ring: (P-1)/P of the buffer sent by each rank).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..allreduce import allgather_ring, reduce_scatter_ring
from ..runtime.comm import Comm
from ..runtime.counting import CountingComm, underlying
from ..runtime.waiting import pauses

ReduceScatter = Callable[[Comm, np.ndarray, list[int]], np.ndarray]
Allgather = Callable[[Comm, np.ndarray, list[int]], np.ndarray]
#: What callers may pass: "ring", "mpi", or a (reduce_scatter, allgather) pair of functions.
CollectivesChoice = str | tuple[ReduceScatter, Allgather]


def reduce_scatter_mpi(comm: Comm, x: np.ndarray, bounds: list[int]) -> np.ndarray:
    """MPI's Reduce_scatter (sum), with the signature above (counted on a CountingComm)."""
    counts = np.diff(bounds).tolist()
    out = np.empty(counts[comm.Get_rank()], dtype=x.dtype)
    comm = comm if isinstance(comm, CountingComm) else underlying(comm)
    comm.Reduce_scatter(np.ascontiguousarray(x), out, recvcounts=counts, op=MPI.SUM)
    return out


def allgather_mpi(comm: Comm, mine: np.ndarray, bounds: list[int]) -> np.ndarray:
    """MPI's Allgatherv, with the signature above (counted on a CountingComm)."""
    out = np.empty(bounds[-1], dtype=mine.dtype)
    comm = comm if isinstance(comm, CountingComm) else underlying(comm)
    comm.Allgatherv(np.ascontiguousarray(mine), [out, np.diff(bounds).tolist()])
    return out


CHOICES: dict[str, tuple[ReduceScatter, Allgather]] = {
    "ring": (reduce_scatter_ring, allgather_ring),
    "mpi": (reduce_scatter_mpi, allgather_mpi),
}


@dataclass
class InFlight:
    """A collective started: its request (None: already complete), its result, the buffers MPI still reads."""

    request: MPI.Request | None
    result: np.ndarray
    inputs: tuple[Any, ...] = ()

    def done(self) -> bool:
        """Let MPI move it on (a Test); whether it has completed. Never blocks."""
        if self.request is not None and self.request.Test():
            self.request, self.inputs = None, ()
        return self.request is None

    def wait(self) -> np.ndarray:
        """Its result, once complete. Tests with the runtime's back-off (sleeps after a few tries),
        so a waiting rank leaves the core to ranks still computing instead of spinning in Wait."""
        for pause in pauses():
            if self.done():
                return self.result
            time.sleep(pause)
        raise AssertionError("pauses() never ends")


class Collectives:
    """Starts reduce-scatters and allgathers: non-blocking for "mpi", run at once for functions."""

    def __init__(self, choice: CollectivesChoice):
        self.reduce_scatter, self.allgather = resolve_collectives(choice)
        self.nonblocking = choice == "mpi"

    def start_reduce_scatter(self, comm: Comm, x: np.ndarray, bounds: list[int]) -> InFlight:
        """Start summing x's shards: rank r's result is the sum of x[bounds[r]:bounds[r+1]]. Keep x until done."""
        if self.nonblocking and not isinstance(comm, CountingComm):
            shard = bounds[1] - bounds[0]
            out = np.empty(shard, dtype=x.dtype)
            return InFlight(underlying(comm).Ireduce_scatter_block(x, out, op=MPI.SUM), out, (x,))
        return InFlight(None, self.reduce_scatter(comm, x, bounds))

    def start_allgather(self, comm: Comm, mine: np.ndarray, bounds: list[int], out: np.ndarray) -> InFlight:
        """Start gathering every rank's `mine` into `out` (bounds[-1] items). Keep both until done."""
        if self.nonblocking and not isinstance(comm, CountingComm):
            return InFlight(underlying(comm).Iallgather(mine, out), out, (mine,))
        out[...] = self.allgather(comm, mine, bounds)
        return InFlight(None, out)


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

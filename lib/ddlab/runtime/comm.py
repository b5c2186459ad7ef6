"""`Comm`: what ddlab's functions need of a communicator, as a type.

An mpi4py `MPI.Comm` has it, and so has `ddlab.runtime.counting.CountingComm`, which checks
hand to a student's function instead. Functions that take either are typed `Comm`;
those that call collectives on the real communicator take `MPI.Comm` (use
`ddlab.runtime.counting.underlying(comm)` to get it from a `Comm`).

`first_ranks(comm, n)` is the communicator of comm's first n ranks, which checks, cost
sweeps and measurements use to run the same thing on 1, 2, ..., P ranks.
"""

from __future__ import annotations

from typing import Any, Protocol

from mpi4py import MPI


class Comm(Protocol):
    """Rank, size, point-to-point messages and the MPI library's Allreduce, Allgather and Allgatherv (buffer API),
    as mpi4py spells them."""

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None: ...

    def Recv(self, buf: Any, source: int = ..., tag: int = ..., status: MPI.Status | None = None) -> None: ...

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ...,
        recvtag: int = ...,
        status: MPI.Status | None = None,
    ) -> None: ...

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> MPI.Request: ...

    def Irecv(self, buf: Any, source: int = ..., tag: int = ...) -> MPI.Request: ...

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = ...) -> None: ...

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None: ...

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None: ...


def first_ranks(comm: MPI.Comm, n: int) -> MPI.Comm | None:
    """The communicator of comm's ranks 0..n-1 (in order), None on the others.

    Collective: every rank of comm calls it. The caller frees the result (`sub.Free()`).
    """
    rank = comm.Get_rank()
    sub = comm.Split(0 if rank < n else MPI.UNDEFINED, rank)
    return None if sub == MPI.COMM_NULL else sub

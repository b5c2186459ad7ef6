"""`Comm`: what ddlab's functions need of a communicator, as a type.

An mpi4py `MPI.Comm` has it, and so has `ddlab.counting.CountingComm`, which checks
hand to a student's function instead. Functions that take either are typed `Comm`;
those that call collectives on the real communicator take `MPI.Comm` (use
`ddlab.counting.underlying(comm)` to get it from a `Comm`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mpi4py import MPI


class Comm(Protocol):
    """Rank, size and point-to-point messages (buffer API), as mpi4py spells them."""

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None: ...

    def Recv(self, buf: Any, source: int = ..., tag: int = ...,
             status: MPI.Status | None = None) -> None: ...

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ..., recvtag: int = ...,
                 status: MPI.Status | None = None) -> None: ...

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> MPI.Request: ...

    def Irecv(self, buf: Any, source: int = ..., tag: int = ...) -> MPI.Request: ...

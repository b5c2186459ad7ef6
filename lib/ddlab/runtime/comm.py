"""`Comm`: what ddlab's functions need of a communicator, as a type.

An mpi4py `MPI.Comm` has it, and so has `ddlab.runtime.counting.CountingComm`, which checks
hand to a student's function instead. Functions that take either are typed `Comm`;
those that call collectives on the real communicator take `MPI.Comm` (use
`ddlab.runtime.counting.underlying(comm)` to get it from a `Comm`).

`first_ranks(comm, n)` is the communicator of comm's first n ranks, which checks, cost
sweeps and measurements use to run the same thing on 1, 2, ..., P ranks. `drain(comm, timeout)`
receives whatever is still pending on comm, so that code which gave up on its messages leaves
none behind for the caller's next receive.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

import numpy as np
from mpi4py import MPI

from .waiting import pauses


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


class Leftover(NamedTuple):
    """A message drain() found unreceived: its sender, tag and bytes. tag None: the sender's end marker never
    came (a receive left posted on this rank took it)."""

    source: int
    tag: int | None
    nbytes: int


def drain(comm: MPI.Comm, timeout: float) -> list[Leftover]:
    """Receive (and drop) every message still pending for this rank on comm; what it found (a collective).

    Call it once every rank is done sending on comm (after a barrier). Each rank sends an empty marker with
    the largest tag MPI allows (no ddlab code sends one) to every rank, itself too, then receives from each
    sender whatever arrives before that sender's marker. MPI's non-overtaking rule (one sender's messages
    on one communicator match receives in the order they were sent) makes this exact: a message sent
    before the marker is found even if it is still on its way, where a barrier orders nothing. The send of
    a message found completes. A marker still missing after `timeout` seconds is reported (tag None).
    """
    size = comm.Get_size()
    marker = int(comm.Get_attr(MPI.TAG_UB) or 32767)  # MPI guarantees at least 32767
    empty = np.empty(0, np.uint8)
    sends = [comm.Isend([empty, MPI.BYTE], dest, marker) for dest in range(size)]
    found: list[Leftover] = []
    status = MPI.Status()
    for source in range(size):
        deadline, waits = time.monotonic() + timeout, pauses()
        while True:
            if not comm.Iprobe(source, MPI.ANY_TAG, status):
                if time.monotonic() > deadline:
                    found.append(Leftover(source, None, 0))
                    break
                time.sleep(next(waits))
                continue
            tag, nbytes = status.Get_tag(), status.Get_count(MPI.BYTE)
            comm.Recv([np.empty(nbytes, np.uint8), MPI.BYTE], source, tag)
            if tag == marker:
                break
            found.append(Leftover(source, tag, nbytes))
    MPI.Request.Waitall(sends)
    return found

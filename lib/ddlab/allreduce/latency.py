"""What a small allreduce call costs, part by part: lab 03's latency section and bench/allreduce.py.

`call_parts(comm, counting)` returns callables with the allreduce signature, each doing one
part of what the reference recursive doubling does, to be timed side by side with
`ddlab.allreduce.cost.time_allreduce`:

- the messages alone: a bare mpi4py Sendrecv loop of recursive doubling's pattern into buffers
  made once (the floor for anything written in Python), then with the adds;
- the allocations a call makes (a copy of x and a scratch vector);
- the agreement on length and dtype as a collective of its own (`agree_on_input`);
- the same messages waited for through a deadline watch (`ddlab.runtime.waiting.Watch`), as a
  check's communicator waits;
- the reference run on a CountingComm, as a check runs it (textbook messages, the agreement on
  the side, every wait watched);
- the reference itself, whose agreement rides in its messages;
- and MPI_Allreduce, into a new array as the others return one.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..runtime.counting import CountingComm
from .algorithms import (
    TAG,
    agree_on_input,
    allreduce_mpi,
    allreduce_recursive_doubling,
    doubling_steps,
)

#: The name of MPI's own allreduce among the parts (the baseline of every ratio).
MPI_PART = "MPI_Allreduce (new array)"


def call_parts(comm: MPI.Comm, counting: CountingComm) -> dict[str, Callable[[MPI.Comm, np.ndarray], Any]]:
    """The parts of a small call, by name (see the module's docstring); `counting` wraps `comm`."""
    steps = doubling_steps(comm.Get_rank(), comm.Get_size())
    kept: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def buffers(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return kept.setdefault(x.nbytes, (x.copy(), np.empty_like(x)))

    def messages(comm: MPI.Comm, x: np.ndarray, add: bool = False) -> None:
        work, scratch = buffers(x)
        for kind, peer in steps:
            if kind == "swap":
                comm.Sendrecv(work, dest=peer, sendtag=TAG, recvbuf=scratch, source=peer, recvtag=TAG)
            elif kind == "send":
                comm.Send(work, dest=peer, tag=TAG)
            else:
                comm.Recv(scratch, source=peer, tag=TAG)
            if add and kind != "send":
                np.add(work, scratch, out=scratch)  # work stays x: no overflow over repeats

    def watched(comm: MPI.Comm, x: np.ndarray) -> None:
        work, scratch = buffers(x)
        for kind, peer in steps:
            requests = [comm.Irecv(scratch, source=peer, tag=TAG)] if kind != "send" else []
            requests += [comm.Isend(work, dest=peer, tag=TAG)] if kind != "recv" else []

            def done(requests: list[MPI.Request] = requests) -> bool:
                return bool(MPI.Request.Testall(requests))

            counting.watch.poll(done, f"{kind} with rank {peer}")

    def counted(comm: MPI.Comm, x: np.ndarray) -> None:
        allreduce_recursive_doubling(counting, x)
        counting.traffic.events.clear()

    return {
        MPI_PART: allreduce_mpi,
        "messages (bare Sendrecv loop)": messages,
        "messages + adds": lambda comm, x: messages(comm, x, add=True),
        "allocations (copy + scratch)": lambda comm, x: (np.array(x, copy=True), np.empty_like(x)),
        "agreement as its own collective": agree_on_input,
        "messages through the deadline watch": watched,
        "reference on a CountingComm": counted,
        "reference recursive doubling": allreduce_recursive_doubling,
    }

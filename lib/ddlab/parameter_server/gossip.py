"""Decentralized training without a server: average with a ring neighbour instead of with everyone.

`gossip_step` is exercise 10.4: one synchronous averaging step with the left
neighbour, the mixing matrix W[i, i] = W[i, i-1] = 1/2 (doubly stochastic: it keeps the
replicas' mean), as in D-PSGD (Lian et al., NeurIPS 2017). `AsyncGossip` is the
asynchronous version training uses, in the setting of AD-PSGD (Lian et al.,
"Asynchronous Decentralized Parallel Stochastic Gradient Descent", ICML 2018): each rank
posts its parameters to the right neighbour without waiting, and averages with the
newest parameters that have arrived from the left, if any, so no rank ever waits
for another during training. Those may be several steps old (staleness), and only the
receiver averages (AD-PSGD averages a pair atomically), so the replicas' mean drifts.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..runtime.comm import Comm
from ..runtime.reference import reference
from ..runtime.waiting import Watch

GOSSIP = 103


@reference("gossip_step")
def gossip_step(comm: Comm, params: np.ndarray) -> np.ndarray:
    """Exercise 10.4: send params to rank + 1, receive the left neighbour's, return the average of the two.

    A new float64 array; params is left unchanged. On one rank, a copy of params.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return params.copy()
    theirs = np.empty_like(params)
    comm.Sendrecv(params, (rank + 1) % size, GOSSIP, theirs, (rank - 1) % size, GOSSIP)
    return (params + theirs) / 2


class AsyncGossip:
    """One rank's asynchronous gossip on comm: post to the right, average with the newest from the left."""

    def __init__(self, comm: Comm, n: int, watch: Watch):
        self.comm, self.watch = comm, watch
        rank, self.size = comm.Get_rank(), comm.Get_size()
        self.right, self.left = (rank + 1) % self.size, (rank - 1) % self.size
        self.sends: list[tuple[MPI.Request, np.ndarray]] = []
        self.sent = self.received = 0
        self.buf = np.empty(n)
        self.request = comm.Irecv(self.buf, self.left, GOSSIP) if self.size > 1 else None
        self.averaged_with = 0  # steps that found a neighbour's parameters to average with

    def _newest(self) -> np.ndarray | None:
        """The newest parameters arrived from the left (reposting the receive), or None."""
        newest = None
        while self.request is not None and self.request.Test():
            newest = self.buf.copy()
            self.received += 1
            self.request = self.comm.Irecv(self.buf, self.left, GOSSIP)
        return newest

    def step(self, params: np.ndarray) -> np.ndarray:
        """Post params to the right; return their average with the newest from the left (or params)."""
        if self.size == 1:
            return params
        copy = params.copy()
        self.sends.append((self.comm.Isend(copy, self.right, GOSSIP), copy))
        self.sent += 1
        self.sends = [(r, b) for r, b in self.sends if not r.Test()]
        theirs = self._newest()
        if theirs is None:
            return params
        self.averaged_with += 1
        return (params + theirs) / 2

    def _drained(self, total: int) -> bool:
        self._newest()
        return self.received >= total

    def finish(self) -> None:
        """A collective at the end: receive what is still on its way, cancel the open receive."""
        if self.size == 1:
            return
        counts = np.array([self.sent]), np.empty(1, dtype=np.int64)
        self.comm.Sendrecv(counts[0], self.right, GOSSIP + 1, counts[1], self.left, GOSSIP + 1)
        total = int(counts[1][0])
        assert self.request is not None
        self.watch.poll(lambda: self._drained(total), f"{total} gossip messages from rank {self.left}")
        self.request.Cancel()
        self.request.Wait()
        self.watch.poll(lambda: all(r.Test() for r, _ in self.sends), "gossip messages to be received")

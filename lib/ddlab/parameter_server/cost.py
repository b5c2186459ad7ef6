"""What one step's communication costs: a (sharded) parameter server against the ring allreduce, modelled and measured.

The model follows Ben-Nun and Hoefler ("Demystifying Parallel and Distributed Deep
Learning", ACM Computing Surveys 2019): each of P workers pushes m parameters of
gamma bytes and pulls them back, so every one of s server shards carries P m gamma / s
bytes in and as many out on its one link:

    T_server = 2 P gamma m G / s + 2 L

with G seconds per byte and L the latency (lab 01's beta and alpha). The ring
allreduce (lab 03) carries 2 (P - 1) / P m gamma bytes per rank whatever P, in
2 (P - 1) messages: `ddlab.allreduce.cost.predict("ring", ...)`.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..allreduce import Allreduce
from ..allreduce.cost import Link, Terms, predict
from ..runtime.comm import first_ranks
from .problem import LeastSquares
from .run import train

GAMMA = 8  # bytes per parameter: float64


def server_seconds(workers: int, servers: int, n: int, link: Link) -> float:
    """T = 2 P gamma m G / s + 2 L: one synchronous step through s server shards of n parameters.

    The critical path is one server shard's link: 2 messages' latency (push, then pull), and
    2 P gamma m / s bytes through it."""
    return float(Terms(2.0, 2 * workers * GAMMA * n / servers, 0.0).seconds(link))


def allreduce_seconds(workers: int, n: int, link: Link) -> float:
    """The ring allreduce of n parameters over P workers (lab 03's model, with its gamma term for the adds)."""
    return float(predict("ring", workers, GAMMA * n, link))


def seconds_per_step(
    comm: MPI.Comm,
    mode: str,
    workers: int,
    n: int,
    *,
    servers: int = 1,
    steps: int = 5,
    repeats: int = 3,
    allreduce: Allreduce | None = None,
) -> float:
    """Seconds per step of `mode` with `workers` workers on the first ranks of comm, no compute (a collective).

    Server modes use servers + workers ranks, "allreduce" (with `allreduce`, MPI's by
    default) the workers alone; the other ranks wait. The fastest of `repeats` runs
    counts (other programs on the machine only ever add time); every rank gets it.
    """
    used = workers + (0 if mode == "allreduce" else servers)
    if used > comm.Get_size():
        raise ValueError(f"{mode!r} with {workers} workers needs {used} ranks, the communicator has {comm.Get_size()}")
    sub = first_ranks(comm, used)
    seconds = 0.0
    if sub is not None:
        problem = LeastSquares(n=n, samples=2, batch=1)
        seconds = min(
            train(sub, mode, problem, steps, servers=servers, allreduce=allreduce).seconds / steps
            for _ in range(repeats)
        )
        sub.Free()
    return float(comm.allreduce(seconds, op=MPI.MAX))


def predicted(workers: list[int], n: int, link: Link, servers: int = 1) -> dict[str, np.ndarray]:
    """Both models' seconds per step for each P in workers: {"server": ..., "ring allreduce": ...}."""
    return {
        "server": np.array([server_seconds(p, servers, n, link) for p in workers]),
        "ring allreduce": np.array([allreduce_seconds(p, n, link) for p in workers]),
    }

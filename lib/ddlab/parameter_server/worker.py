"""A worker: pull parameters from every server, compute a gradient, push its slices back; repeat."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..runtime.comm import Comm
from ..runtime.reference import reference
from ..runtime.waiting import Watch
from .messages import GRADIENT, PARAMETERS, PARAMETERS_HEADER

Gradient = Callable[[np.ndarray, int], np.ndarray]  # (parameters, step) -> gradient


@dataclass
class WorkerLog:
    """What one worker did."""

    pushed: list[int] = field(default_factory=list)  # steps whose gradient was sent
    stopped_by_server: bool = False


def pull(comm: Comm, bounds: list[tuple[int, int]], n: int, watch: Watch) -> tuple[np.ndarray, np.ndarray, bool]:
    """Receive the parameter slice of each server (server i is rank i): (parameters, versions, go)."""
    bufs = [np.empty(PARAMETERS_HEADER + b - a) for a, b in bounds]
    requests = [comm.Irecv(buf, server, PARAMETERS) for server, buf in enumerate(bufs)]
    watch.poll(lambda: all(r.Test() for r in requests) if requests else True, "parameters from the servers")
    params = np.empty(n)
    for (a, b), buf in zip(bounds, bufs):
        params[a:b] = buf[PARAMETERS_HEADER:]
    return params, np.array([buf[0] for buf in bufs]), all(buf[1] == 1 for buf in bufs)


def push(
    comm: Comm,
    bounds: list[tuple[int, int]],
    worker: int,
    step: int,
    versions: np.ndarray,
    grad: np.ndarray,
    more: bool,
) -> list[tuple[MPI.Request, np.ndarray]]:
    """Send each server its slice of the gradient without waiting; return the requests and buffers."""
    sends = []
    for server, (a, b) in enumerate(bounds):
        buf = np.concatenate([[worker, step, versions[server], float(more)], grad[a:b]])
        sends.append((comm.Isend(buf, server, GRADIENT), buf))
    return sends


@reference("async_worker")
def work(
    comm: Comm,
    bounds: list[tuple[int, int]],
    n: int,
    worker: int,
    gradient: Gradient,
    steps: int,
    watch: Watch,
    compute: np.ndarray | None = None,
) -> WorkerLog:
    """Run `steps` steps (pull, compute for compute[step] seconds at least, push); stop if a server says so."""
    log = WorkerLog()
    sends: list[tuple[MPI.Request, np.ndarray]] = []
    for step in range(steps):
        params, versions, go = pull(comm, bounds, n, watch)
        if not go:
            log.stopped_by_server = True
            break
        began = time.perf_counter()
        grad = gradient(params, step)
        time.sleep(max(0.0, (0.0 if compute is None else compute[step]) - (time.perf_counter() - began)))
        sends += push(comm, bounds, worker, step, versions, grad, more=step < steps - 1)
        log.pushed.append(step)
        sends = [(r, b) for r, b in sends if not r.Test()]
    watch.poll(lambda: all(r.Test() for r, _ in sends), "the servers to receive the last gradients")
    return log

"""This machine as a `Platform`, measured in about a minute: collectives, ping-pong, compute, contention.

A collective over comm; every rank gets the same Platform. All ranks count as one node.

- Curves: Allreduce, Allgather and Reduce_scatter of the MPI library on the first n
  ranks for n = 2 .. P, and ping-pong between ranks 0 and 1 (lab 01's sweep), over
  message sizes; each point is the median of `repeats` calls, a call counting as its
  slowest rank's time (ranks start together after a barrier).
- Links: alpha and beta fitted to the ping-pong (lab 01); intra and inter are the same here.
- Compute: the FLOP rate of a matrix product on one rank alone, and the contention
  coefficient: how much longer the same product takes while n ranks run it at once
  (n = 1 .. P), the median of `repeats` rounds. On a laptop with fewer cores than ranks,
  or cores sharing memory bandwidth, it is well above 1.
- Sync: what a blocking exchange costs beyond its message while every rank computes
  (`measure_sync`): a partner descheduled on a shared core must run before it answers.
  `measure_exchange` and `exchange_curve` time any exchange so, e.g. lab 08's own halo
  exchange at the sizes a run sends (`ddlab.oracle.validate` does).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np
import psutil
import torch
from mpi4py import MPI

from ..allreduce.cost import Link
from ..p2p import fit_alpha_beta, idle_wait, sweep
from ..runtime.comm import first_ranks
from .platform import Curves, Platform

SIZES = (8, 256, 8 * 2**10, 64 * 2**10, 512 * 2**10, 4 * 2**20, 16 * 2**20)


def _collective(comm: MPI.Comm, op: str, nbytes: int) -> Callable[[], Any]:
    p = comm.Get_size()
    count = max(nbytes // 4 // p * p, p)  # whole float32 elements, a multiple of p
    whole = np.ones(count, dtype=np.float32)
    part = np.ones(count // p, dtype=np.float32)
    if op == "allreduce":
        out = np.empty_like(whole)
        return lambda: comm.Allreduce(whole, out, op=MPI.SUM)
    if op == "allgather":
        return lambda: comm.Allgather(part, whole)
    return lambda: comm.Reduce_scatter_block(whole, part, op=MPI.SUM)


def time_collective(comm: MPI.Comm, op: str, nbytes: int, repeats: int) -> float:
    """Median seconds of one call of op on nbytes (the whole result's bytes), slowest rank's."""
    call = _collective(comm, op, nbytes)
    call()
    times = []
    for _ in range(repeats):
        comm.Barrier()
        start = MPI.Wtime()
        call()
        times.append(comm.allreduce(MPI.Wtime() - start, op=MPI.MAX))
    return statistics.median(times)


def _matmul_seconds(n: int = 384, reps: int = 40) -> float:
    a = torch.ones(n, n)
    start = time.perf_counter()
    for _ in range(reps):
        a @ a
    return (time.perf_counter() - start) / reps


def measure_contention(comm: MPI.Comm, repeats: int = 5, n: int = 384) -> tuple[float, tuple[float, ...]]:
    """(FLOP/s of one rank alone, slowdown with 1..P ranks computing at once). A collective."""
    rank, size = comm.Get_rank(), comm.Get_size()
    _matmul_seconds(n, 2)
    rounds: list[list[float]] = [[] for _ in range(size)]
    for _ in range(repeats):
        for busy in range(1, size + 1):
            comm.Barrier()
            seconds = _matmul_seconds(n) if rank < busy else 0.0
            idle_wait(comm.Ibarrier())  # idle ranks sleep, not spin
            rounds[busy - 1].append(comm.allreduce(seconds, op=MPI.MAX))
    alone = statistics.median(rounds[0])
    slowdown = tuple(max(1.0, statistics.median(r) / alone) for r in rounds)
    return 2 * n**3 / alone, slowdown


def _busy_for(comm: MPI.Comm, seconds: float, n: int = 128) -> Callable[[], float]:
    """A loop of matrix products that took about `seconds` on rank 0 (the same count on every rank)."""
    reps = comm.bcast(max(1, round(seconds / max(_matmul_seconds(n, 4), 1e-9))), root=0)
    return lambda: _matmul_seconds(n, reps)


def measure_exchange(comm: MPI.Comm, exchange: Callable[[], object], gap: float, rounds: int = 10) -> float:
    """Seconds one call of `exchange` adds while every rank computes `gap` seconds between calls.

    Every rank runs `rounds` chunks of matrix products of about `gap` seconds each, once
    alone and once with a call of exchange (a collective, or an exchange with neighbours,
    over comm) after each chunk; the slowest rank's difference per call, at least 0. On
    cores shared by more ranks than cores, this is the message's time plus the wait for a
    partner that is not running: what the exchange costs inside a training step.
    """
    work = _busy_for(comm, gap)

    def loop(calls: bool) -> float:
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            work()
            if calls:
                exchange()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    loop(True)
    without, with_calls = loop(False), loop(True)
    return max(0.0, (with_calls - without) / rounds)


def measure_sync(comm: MPI.Comm, rounds: int = 10, gap: float = 4e-3) -> float:
    """Seconds an 8-byte blocking Allreduce adds while every rank computes (`measure_exchange`)."""
    token = np.zeros(1)
    return measure_exchange(comm, lambda: comm.Allreduce(MPI.IN_PLACE, token), gap, rounds)


def exchange_curve(
    comm: MPI.Comm, make: Callable[[int], Callable[[], object]], sizes: Sequence[int], gap: float, rounds: int = 10
) -> tuple[list[float], list[float]]:
    """(sizes, seconds): `measure_exchange` of make(nbytes)() at each size, the same on every rank."""
    seconds = [measure_exchange(comm, make(n), gap, rounds) for n in sizes]
    return [float(n) for n in sizes], comm.bcast(seconds, root=0)


def measure_links(comm: MPI.Comm, sizes: Sequence[int] = SIZES, repeats: int = 5) -> tuple[Curves, Link]:
    """The collectives' and the ping-pong's curves (see the module docstring) and the link fitted to the
    ping-pong; every rank gets the same. A collective."""
    size = comm.Get_size()
    curves = Curves()
    for n in range(2, size + 1):
        sub = first_ranks(comm, n)
        if sub is not None:
            for op in ("allreduce", "allgather", "reduce_scatter"):
                curves.add(op, n, list(sizes), [time_collective(sub, op, s, repeats) for s in sizes])
            sub.Free()
        comm.Barrier()
    ping = sweep(comm, list(sizes)) if size > 1 else np.full(len(sizes), 1e-6)
    curves.add("p2p", 2, list(sizes), list(ping))
    alpha, beta = fit_alpha_beta(list(sizes), list(ping))
    link = Link(max(alpha, 0.0), max(beta, 1e-12))
    table, link = comm.bcast((curves.table, link), root=0)
    return Curves(dict(table)), link


def measure_platform(
    comm: MPI.Comm, sizes: Sequence[int] = SIZES, repeats: int = 5, name: str = "this machine"
) -> Platform:
    """This machine's Platform (see the module docstring); every rank gets the same one."""
    size = comm.Get_size()
    torch.set_num_threads(1)
    curves, link = measure_links(comm, sizes, repeats)
    flops, contention = measure_contention(comm, repeats)
    sync = comm.bcast(measure_sync(comm), root=0)
    memory = psutil.virtual_memory().total // size
    contention = comm.bcast(contention, root=0)
    flops = comm.bcast(flops, root=0)
    return Platform(
        name=name,
        devices_per_node=size,
        flops=flops,
        memory=int(memory),
        intra=link,
        inter=link,
        curves=curves,
        contention=contention,
        sync=sync,
        sources={
            "all": "measured by ddlab.oracle.measure_platform on this machine",
            "inter": "one machine: the same link as intra",
        },
    )

"""What lab 08's implementations cost beyond their layers' compute and MPI's message times, measured.

ParaDL prices a strategy by its layers' compute and the collectives it calls. Lab 08's
spatial and filter layers also do work of their own at every exchange: thin
convolutions at a slab's edges, padding, transposes and copies into message buffers,
Python between the calls. None of it is a layer's FLOPs, and its exchanges are small
messages whose cost on shared cores is mostly the wait for a descheduled partner.
Both are measured here, independently of any training run:

- `overhead_per_exchange`: the implementation's step with its messages replaced by
  stand-ins that move no data (`LocalComm`, `LocalHalo`), every rank running it at
  once, against the compute the oracle predicts for that step from the layers' profile.
- `halo_curve`, `filter_curves`: lab 08's own exchange functions at the message sizes
  a run sends, timed while every rank computes between calls (`measure_exchange`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from ..runtime.comm import Comm
from .measure import exchange_curve

Step = Callable[[], object]


class LocalComm:
    """A stand-in for rank `rank` of `size` ranks whose collectives move no data (outputs: own part, zeros)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:  # noqa: N802  (mpi4py's names)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Allgather(self, send: np.ndarray, recv: np.ndarray) -> None:  # noqa: N802
        recv.reshape(self.size, -1)[:] = np.asarray(send).reshape(1, -1)

    def Allgatherv(self, send: np.ndarray, spec: list[Any]) -> None:  # noqa: N802
        recv, counts = spec
        start = sum(counts[: self.rank])
        recv.reshape(-1)[:] = 0
        recv.reshape(-1)[start : start + send.size] = send.reshape(-1)

    def Allreduce(self, send: np.ndarray, recv: np.ndarray, op: Any = None) -> None:  # noqa: N802
        recv[...] = send


class LocalHalo(torch.autograd.Function):
    """`HaloExchange` without messages: zero halos forward, the halo's gradient added locally backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, halo: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.halo, ctx.rows = halo, x.shape[2]
        zeros = x.new_zeros(x.shape[0], x.shape[1], halo, x.shape[3])
        return zeros, zeros.clone()

    @staticmethod
    def backward(ctx: Any, grad_above: torch.Tensor, grad_below: torch.Tensor) -> tuple:
        n, c, _, w = grad_above.shape
        grad_x = grad_above.new_zeros(n, c, ctx.rows, w)
        grad_x[:, :, : ctx.halo] += grad_below.detach().contiguous()
        grad_x[:, :, -ctx.halo :] += grad_above.detach().contiguous()
        return grad_x, None, None


def overhead_per_exchange(comm: MPI.Comm, stubbed: Step, compute: float, units: float, repeats: int = 3) -> float:
    """Seconds per exchange and sample the implementation adds: (stubbed step - compute) / units, at least 0.

    Every rank runs the stubbed step at once, `repeats` times after one warm-up; the
    slowest rank's median counts. `compute`: the seconds the oracle predicts for the
    step's layers (and update), contention included; `units` = exchanges per step x samples.
    """
    stubbed()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        stubbed()
        times.append(time.perf_counter() - start)
    own = comm.allreduce(statistics.median(times), op=MPI.MAX)
    return max(0.0, own - compute) / max(units, 1e-12)


def halo_curve(comm: MPI.Comm, sizes: Sequence[float], gap: float) -> tuple[list[float], list[float]]:
    """Seconds of one `exchange_rows` (both neighbours) of each size in bytes, every rank computing `gap` between."""
    from ..intra_layer import exchange_rows

    def make(nbytes: int) -> Step:
        rows = torch.zeros(1, 1, 1, max(1, nbytes // 4))  # one row of (N, C, rows, W), nbytes long
        return lambda: exchange_rows(comm, rows, rows, (91, 92))

    return exchange_curve(comm, make, [int(n) for n in sizes], gap)


def filter_curves(
    comm: MPI.Comm, outputs: Sequence[float], inputs: Sequence[float], gap: float
) -> dict[str, tuple[list[float], list[float]]]:
    """Lab 08's filter collectives timed so: "filter allgather" of whole outputs, "filter allreduce" of inputs."""
    from ..intra_layer import allgather_channels, allreduce_sum

    p = comm.Get_size()

    def gather(nbytes: int) -> Step:
        mine = torch.zeros(1, 1, 1, max(1, nbytes // 4 // p))
        return lambda: allgather_channels(comm, mine)

    def reduce(nbytes: int) -> Step:
        whole = torch.zeros(max(1, nbytes // 4))
        return lambda: allreduce_sum(comm, whole)

    return {
        "filter allgather": exchange_curve(comm, gather, [int(n) for n in outputs], gap),
        "filter allreduce": exchange_curve(comm, reduce, [int(n) for n in inputs], gap),
    }

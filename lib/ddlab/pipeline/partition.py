"""Balanced pipeline stages by dynamic programming over measured per-layer costs, as PipeDream does.

A pipeline runs at the pace of its slowest stage. PipeDream (Narayanan et al.,
"PipeDream: Generalized Pipeline Parallelism for DNN Training", 2019) profiles every
layer and finds, by dynamic programming, the contiguous split whose slowest stage
is fastest. With T(a, b) the time of a stage holding layers a..b-1,

    best(j, s) = min over i < j of max(best(i, s-1), T(i, j)),   best(j, 1) = T(0, j),

and best(n, k) is the answer. Here T(a, b) counts the stage's layers (forward and
backward CPU seconds) and its messages (each tensor entering or leaving it, sent
once and its gradient once, at alpha + beta * bytes): on CPU ranks the stages do
the copying themselves. UNet's skips make a stage's messages depend on where it
starts and ends, but not on the other stages, so the recurrence stays exact.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from mpi4py import MPI

from ..comm import Comm
from ..counting import underlying
from ..model_parallel import Crossings, Mailbox, profile_layers
from ..models.unet import UNet

StageTime = Callable[[int, int], float]


def pipedream_partition(n: int, k: int, stage_time: StageTime) -> list[int]:
    """Bounds of k contiguous non-empty stages of n layers minimising the largest stage_time(a, b)."""
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} layers into {k} non-empty stages")
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]  # best[s][j]: layers 0..j-1 in s stages
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    for j in range(1, n + 1):
        best[1][j] = stage_time(0, j)
    for s in range(2, k + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                candidate = max(best[s - 1][i], stage_time(i, j))
                if candidate < best[s][j]:
                    best[s][j], cut[s][j] = candidate, i
    bounds, j = [n], n
    for s in range(k, 1, -1):
        j = cut[s][j]
        bounds.append(j)
    return [0] + bounds[::-1]


class StageTimes:
    """T(a, b): seconds of a stage holding layers a..b-1, from per-layer compute and its messages."""

    def __init__(self, compute: list[float], crossings: Callable[[int, int], list[int]], alpha: float, beta: float):
        self.compute, self.crossings, self.alpha, self.beta = list(compute), crossings, alpha, beta

    def __call__(self, a: int, b: int) -> float:
        return sum(self.compute[a:b]) + sum(self.alpha + self.beta * nbytes for nbytes in self.crossings(a, b))

    def of(self, bounds: list[int]) -> list[float]:
        """Every stage's time under a split."""
        return [self(a, b) for a, b in zip(bounds, bounds[1:])]


def message_cost(repeats: int = 9, large: int = 2**20) -> tuple[float, float]:
    """(alpha, beta): CPU seconds to send and receive one tensor message: alpha + beta * bytes.

    Measured through a Mailbox on MPI.COMM_SELF (a rank messaging itself pays both
    sides), the median of `repeats` for an empty and a `large` tensor.
    """
    mailbox = Mailbox(MPI.COMM_SELF)

    def seconds(nbytes: int) -> float:
        tensor, times = torch.zeros(nbytes // 4), []
        for _ in range(repeats):
            start = time.thread_time()
            mailbox.post(tensor, 0, 0)
            mailbox.take(tuple(tensor.shape), tensor.dtype, 0, 0)
            mailbox.flush()
            times.append(time.thread_time() - start)
        return statistics.median(times)

    small, big = seconds(0), seconds(large)
    mailbox.free()
    return small, max(big - small, 0.0) / large


def measured_stage_times(comm: Comm, model: UNet, images: torch.Tensor, masks: torch.Tensor,
                         repeats: int = 3) -> StageTimes:
    """T(a, b) for this micro-batch, from layer and message costs measured on every rank.

    Every rank profiles the whole model `repeats` times at once (so the machine is
    as busy as during the pipeline) and each layer's cost is the median of all
    those measurements. A collective over comm.
    """
    raw = underlying(comm)
    mine = [[c.compute for c in profile_layers(model, images, masks, repeats=1)] for _ in range(repeats)]
    runs = [run for rank_runs in raw.allgather(mine) for run in rank_runs]
    compute = [AGGREGATE(layer) for layer in zip(*runs)]
    alphas, betas = zip(*raw.allgather(message_cost()))
    crossings = Crossings(model, tuple(images.shape[1:]), images.shape[0])
    return StageTimes(compute, crossings, AGGREGATE(alphas), AGGREGATE(betas))

AGGREGATE = min

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

Balancing forward plus backward is all 1F1B needs: in its steady state every stage
runs one of each per slot. GPipe runs all forwards, then all backwards, each phase
at the pace of its slowest stage *in that direction*; a stage with a cheap forward
and an expensive backward (UNet's full-resolution encoder) can balance the sum and
still pace the backwards. `StageTimes.per_direction` scores a stage by its slower
direction, each measured against the whole model's time in that direction, so the
same recurrence balances both directions at once.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from mpi4py import MPI

from ..model_parallel import Crossings, Mailbox, profile_layers
from ..models.unet import UNet
from ..runtime.comm import Comm
from ..runtime.counting import underlying
from ..runtime.reference import reference

StageTime = Callable[[int, int], float]


@reference("pipedream_partition")
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
    """T(a, b): seconds of a stage holding layers a..b-1, from per-layer forward and backward and its messages."""

    def __init__(
        self,
        forward: list[float],
        backward: list[float],
        crossings: Callable[[int, int], list[int]],
        alpha: float,
        beta: float,
    ):
        self.forward, self.backward = list(forward), list(backward)
        self.crossings, self.alpha, self.beta = crossings, alpha, beta

    def __call__(self, a: int, b: int) -> float:
        return sum(self.directions(a, b))

    def directions(self, a: int, b: int) -> tuple[float, float]:
        """(forward, backward) seconds of the stage; each direction pays half of its messages."""
        messages = sum(self.alpha + self.beta * nbytes for nbytes in self.crossings(a, b)) / 2
        return sum(self.forward[a:b]) + messages, sum(self.backward[a:b]) + messages

    def per_direction(self, a: int, b: int) -> float:
        """The stage's time if both directions were as slow, for their share of the model, as its slower one.

        max(forward / all forwards, backward / all backwards) x (all forwards + all
        backwards): at least T(a, b), equal to it when the stage's forward and
        backward are the same share of the model's. Stages that minimise the largest
        of these are balanced in each direction, not only in their sum.
        """
        forward, backward = self.directions(a, b)
        total_f, total_b = self.directions(0, len(self.forward))
        return max(forward / total_f, backward / total_b) * (total_f + total_b)

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


def measured_stage_times(
    comm: Comm, model: UNet, images: torch.Tensor, masks: torch.Tensor, repeats: int = 3
) -> StageTimes:
    """T(a, b) for this micro-batch, from layer and message costs measured on every rank.

    Every rank profiles the whole model `repeats` times at once (so the machine is
    as busy as during the pipeline) and each layer's cost is the median of all
    those measurements. A collective over comm.
    """
    raw = underlying(comm)
    mine = [[(c.forward, c.backward) for c in profile_layers(model, images, masks, repeats=1)] for _ in range(repeats)]
    runs = [run for rank_runs in raw.allgather(mine) for run in rank_runs]
    forward = [AGGREGATE(f for f, _ in layer) for layer in zip(*runs)]
    backward = [AGGREGATE(b for _, b in layer) for layer in zip(*runs)]
    alphas, betas = zip(*raw.allgather(message_cost()))
    crossings = Crossings(model, tuple(images.shape[1:]), images.shape[0])
    return StageTimes(forward, backward, crossings, AGGREGATE(alphas), AGGREGATE(betas))


AGGREGATE = min

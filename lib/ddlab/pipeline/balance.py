"""Balance stages from measured pipeline steps: the profile proposes, a real step corrects.

A per-layer profile is taken one layer at a time, with its inputs warm in the cache
and nothing else going on. Inside a pipeline a stage starts from tensors that just
arrived, shares its core with other ranks, and pays for its messages, so it can run
slower than its layers' profile says, and not by the same factor on every stage.
Calibration closes the loop: run a step with the proposed split, scale each layer's forward and
backward cost by how much slower its stage's were, solve again; keep the split whose
measured stages were most even.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models.unet import UNet
from ..runtime.comm import Comm
from .partition import StageTimes, pipedream_partition
from .runner import measure_pipeline
from .schedules import one_f_one_b

Partition = Callable[[int, int, Callable[[int, int], float]], list[int]]


@dataclass
class Calibration:
    """Each round's split, its predicted and measured (forward, backward) seconds per stage and micro-batch, and the best split."""

    rounds: list[tuple[list[int], list[tuple[float, float]], list[tuple[float, float]]]]
    best: list[int]

    @staticmethod
    def imbalance(times: list[tuple[float, float]]) -> float:
        """Slowest stage over the mean, in the less even of the two directions (1: both perfectly even)."""
        return max(max(column) / (sum(column) / len(column)) for column in zip(*times))


def calibrate(
    comm: Comm,
    model: UNet,
    images: torch.Tensor,
    masks: torch.Tensor,
    stage_times: StageTimes,
    m: int,
    rounds: int = 3,
    partition: Partition = pipedream_partition,
    repeats: int = 3,
) -> Calibration:
    """Solve, measure a 1F1B step of m micro-batches (images holds m of them), rescale, solve again.

    Each stage is scored by its slower direction (`StageTimes.per_direction`), and each
    layer's forward (backward) cost is rescaled by how much slower its stage's forwards
    (backwards) really ran. A collective over comm; every rank returns the same Calibration.
    """
    n, k = len(model.layers), comm.Get_size()
    times, history = stage_times, []
    for _ in range(rounds):
        bounds = partition(n, k, times.per_direction)
        run = measure_pipeline(comm, model, bounds, one_f_one_b, m, images, masks, repeats=repeats)
        measured = [(f / m, b / m) for f, b in run.directions]
        predicted = [times.directions(a, b) for a, b in zip(bounds, bounds[1:])]
        history.append((bounds, predicted, measured))
        forward, backward = list(times.forward), list(times.backward)
        for (a, b), (f, g) in zip(zip(bounds, bounds[1:]), measured):
            f_scale, b_scale = f / max(sum(forward[a:b]), 1e-12), g / max(sum(backward[a:b]), 1e-12)
            for i in range(a, b):
                forward[i] *= f_scale
                backward[i] *= b_scale
        times = StageTimes(forward, backward, times.crossings, times.alpha, times.beta)
    best = min(history, key=lambda h: Calibration.imbalance(h[2]))[0]
    return Calibration(history, best)

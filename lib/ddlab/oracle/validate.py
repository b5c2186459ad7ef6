"""Predict, then run: each strategy of labs 04-08 on this machine's ranks, measured against the oracle.

Every `run_<strategy>(comm, platform, ...)` is a collective: rank 0 profiles the layers'
compute alone (ParaDL's per-layer times from one device), the oracle predicts, then all
ranks train `steps` steps of the real implementation of that lab under a `Ledger`.
Measured: wall seconds per step (from a common start after a barrier to the last rank's
end; median over steps after one warm-up) and each rank's peak bytes (the ledger's four
parts, plus buffers the ledger does not see: lab 04's bucket buffers). Every rank gets
the same `Validation`.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from mpi4py import MPI
from torch import nn

from ..memory import Ledger
from ..model_parallel import Crossings, polite_barrier
from .describe import ModelInfo, describe, profile_seconds
from .platform import Platform
from .strategies import Prediction, data, pipeline, unet_edges

LR = 0.01


def accuracy(predicted: float, measured: float) -> float:
    """ParaDL's accuracy: 1 - |predicted - measured| / measured."""
    return 1.0 - abs(predicted - measured) / measured


@dataclass
class Validation:
    """A strategy's prediction and what its run measured (memory per rank as the ledger's parts + buffers)."""

    prediction: Prediction
    seconds: float
    memory: list[dict[str, int]]
    rank_kind: list[int]  # which entry of prediction.memory describes each rank

    @property
    def name(self) -> str:
        return self.prediction.label

    @property
    def time_accuracy(self) -> float:
        return accuracy(self.prediction.time, self.seconds)

    def predicted_peak(self, rank: int) -> float:
        return sum(self.prediction.memory[self.rank_kind[rank]].values())

    def measured_peak(self, rank: int) -> int:
        return self.memory[rank]["peak"]

    @property
    def memory_accuracies(self) -> list[float]:
        return [accuracy(self.predicted_peak(r), self.measured_peak(r)) for r in range(len(self.memory))]

    @property
    def memory_accuracy(self) -> float:
        """The worst rank's."""
        return min(self.memory_accuracies)


def _profile(comm: MPI.Comm, make: Callable[[], tuple[nn.Module, torch.Tensor, Callable]], name: str,
             sample_shape: tuple[int, ...]) -> ModelInfo:
    """Rank 0 describes and profiles the model on its per-rank batch alone; every rank gets the result."""
    info = None
    if comm.Get_rank() == 0:
        torch.manual_seed(0)
        model, batch, loss = make()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        info = profile_seconds(describe(model, sample_shape, name, loss=loss), model, batch, loss, optimizer)
    polite_barrier(comm)
    return comm.bcast(info, root=0)


def timed_steps(comm: Any, step: Callable[[], object], steps: int) -> float:
    """Median wall seconds of a step, from a common start to the last rank's end, after one warm-up."""
    raw = comm
    times = []
    for i in range(steps + 1):
        polite_barrier(raw, pause=1e-4)
        start = raw.bcast(time.perf_counter(), root=0)
        step()
        end = raw.allreduce(time.perf_counter(), op=MPI.MAX)
        if i:
            times.append(end - start)
    return statistics.median(times)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


# Lab 04: data parallelism --------------------------------------------------------------------
def run_data(comm: MPI.Comm, platform: Platform, batch: int = 256, hidden: tuple[int, ...] = (1024, 1024, 512),
             steps: int = 5) -> Validation:
    """lab 04's DataParallel on an MLP of `hidden` widths, batch B split over the ranks."""
    from ..data_parallel import DataParallel
    from ..models import make_mlp

    p = comm.Get_size()
    local = batch // p
    x, y = torch.randn(batch, 600), torch.randn(batch, 2)
    loss = lambda out, target=y[:local]: ((out - target) ** 2).sum(dim=1).mean()  # noqa: E731
    info = _profile(comm, lambda: (make_mlp(hidden=hidden), x[:local], loss), "MLP", (600,))
    prediction = data(info, batch, p, platform)
    model = DataParallel(make_mlp(hidden=hidden), comm)
    optimizer = _sgd(model.parameters())
    ledger = Ledger(stage=f"rank {comm.Get_rank()}")
    ledger.watch(model.module, optimizer)
    rows = slice(comm.Get_rank() * local, (comm.Get_rank() + 1) * local)
    mine = (x[rows].clone(), y[rows].clone())  # own storage: a view would be charged the whole batch

    def step() -> None:
        with ledger.activations():
            value = ((model(mine[0]) - mine[1]) ** 2).sum(dim=1).mean()
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    seconds = timed_steps(comm, step, steps)
    ledger.close()
    model.remove_hooks()
    buffers = sum(b.nbytes for b in model.buckets)
    report = {**ledger.report(), "buffers": buffers}
    report["peak"] += buffers
    return Validation(prediction, seconds, comm.allgather(report), [0] * p)


# Labs 06-07: layer and pipeline parallelism -------------------------------------------------------
def _unet_loss(masks: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    # a slice of its own: a view would be charged the whole batch's storage
    return lambda out: nn.functional.cross_entropy(out, masks[:out.shape[0]].clone(), reduction="sum") / masks.numel()


def run_pipeline(comm: MPI.Comm, platform: Platform, m: int = 4, batch: int = 8, side: int = 64,
                 width: int = 4, depth: int = 3, schedule: str = "1f1b", steps: int = 5) -> Validation:
    """lab 06's UNet stages, one per rank, run with lab 07's schedule on M micro-batches (M=1: lab 06)."""
    from ..data.images import make_segmentation
    from ..model_parallel import Stage
    from ..models.unet import UNet
    from ..pipeline import gpipe, one_f_one_b, pipeline_step

    k = comm.Get_size()
    torch.manual_seed(0)
    unet = UNet(width=width, depth=depth)
    images, masks = make_segmentation(batch, side, seed=0)
    micro = batch // m
    shape = (3, side, side)
    info = _profile(comm, lambda: (copy.deepcopy(unet), images[:micro], _unet_loss(masks[:micro])), "UNet", shape)
    crossings = Crossings(unet, shape, batch=1)
    prediction = pipeline(info, batch, k, m, platform, schedule=schedule, edges=unet_edges(crossings))
    bounds = [int(b) for b in prediction.notes.split("bounds ")[1].strip("[]").split(", ")]
    ledger = Ledger(stage=f"stage {comm.Get_rank()}")
    stage = Stage(unet, bounds, comm, shape, ledger=ledger)
    optimizer = _sgd(stage.parameters())
    ledger.watch(stage.layers, optimizer)
    order = one_f_one_b if schedule == "1f1b" else gpipe
    seconds = timed_steps(comm, lambda: pipeline_step(stage, order, images, masks, m, optimizer), steps)
    ledger.close()
    stage.mailbox.free()
    report = {**ledger.report(), "buffers": 0}
    return Validation(prediction, seconds, comm.allgather(report), list(range(k)))

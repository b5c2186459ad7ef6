"""The training loop of labs 04-05: sharded batches, timed phases, evaluation over ranks.

`train` works for any model that averages its own gradients in backward (ddlab's
DataParallel, torch's DistributedDataParallel) or, with `after_backward`, for a
plain model and a function that averages them (a student's `average_gradients`).
On a communicator of one process (MPI.COMM_SELF) it is plain training on one process,
which is how the labs compute the reference that P ranks must match.

Each step's phases are timed with a `ddlab.runtime.trace.Tracer`: data, forward, backward
(communication waits nested inside it are counted as allreduce), optimizer.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from tqdm import tqdm

from ..data.sharding import ShardedSampler, eval_shard
from ..runtime.trace import Tracer

#: Phases of a training step, as the tracer names them.
PHASES = ("data", "forward", "backward", "allreduce", "optimizer")


def threads_per_rank() -> int:
    """Give torch the OMP_NUM_THREADS threads ddlab set for this rank (cores / ranks); return it."""
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or torch.get_num_threads()
    torch.set_num_threads(threads)
    return threads


def progress_bar(total: int, comm: MPI.Comm, desc: str = "", enabled: bool | None = None) -> tqdm:
    """A tqdm bar on rank 0 only; off elsewhere, when enabled=False, or when DDLAB_PROGRESS=0.

    It appears only once a loop has run for 2 seconds, so short loops print nothing.
    The test suite sets DDLAB_PROGRESS=0 so that executed notebooks stay free of bars.
    """
    show = enabled if enabled is not None else os.environ.get("DDLAB_PROGRESS", "1") != "0"
    return tqdm(
        total=total,
        desc=desc,
        disable=not (show and comm.Get_rank() == 0),
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
        delay=2.0,
    )


def squared_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample squared error, summed over the outputs."""
    return ((prediction - target) ** 2).sum(dim=1)


@dataclass
class History:
    """What a call of `train` did on this rank."""

    losses: list[float] = field(default_factory=list)  # mean loss of this rank's samples, per step
    epoch_times: list[float] = field(default_factory=list)  # wall-clock seconds per epoch
    steps: int = 0

    def step_time(self) -> float:
        """Mean seconds per step over all epochs."""
        return sum(self.epoch_times) / max(self.steps, 1)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
    comm: MPI.Comm,
    *,
    epochs: int = 1,
    batch_size: int = 32,
    seed: int = 0,
    start_epoch: int = 0,
    max_steps: int | None = None,
    accumulate: int = 1,
    lr_at: Callable[[int], float] | None = None,
    after_backward: Callable[[], None] | None = None,
    tracer: Tracer | None = None,
    progress: bool | None = None,
    remainder: str = "pad",
    time_budget: float | None = None,
) -> History:
    """Train on this rank's shard for epochs start_epoch..epochs-1 (or max_steps steps per epoch).

    A step takes `accumulate` batches of `batch_size` samples per rank; all but the last
    run under `model.no_sync()` when the model has it, so gradients are averaged once
    per step. The loss of a step is the mean over its samples on all ranks, so P ranks
    with batch b take the same steps as one process with batch P*b.
    `lr_at(step)` multiplies each parameter group's initial learning rate (its "initial_lr",
    set from "lr" on the first call); steps count from start_epoch * steps per epoch.
    With `time_budget` (seconds), training stops after the step during which rank 0's
    clock passed the budget (rank 0 decides and tells the others, so all stop after the
    same step; the last epoch is then partial).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    sampler = ShardedSampler(len(data), rank, size, seed=seed, remainder=remainder)
    tracer = tracer or Tracer(rank, enabled=False)
    # The base rate survives calls (one per epoch, say): torch's schedulers keep it there too.
    base_lrs = [group.setdefault("initial_lr", group["lr"]) for group in optimizer.param_groups]
    per_step = batch_size * accumulate
    steps_per_epoch = -(-len(sampler) // per_step)
    if max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, max_steps)
    history = History()
    global_step = start_epoch * steps_per_epoch
    bar = progress_bar(steps_per_epoch * (epochs - start_epoch), comm, "training", progress)
    model.train()
    started, out_of_time = time.perf_counter(), False
    try:
        for epoch in range(start_epoch, epochs):
            began = time.perf_counter()
            shard = sampler.indices(epoch)
            for step in range(steps_per_epoch):
                chunk = shard[step * per_step : (step + 1) * per_step]
                if lr_at is not None:
                    for group, base in zip(optimizer.param_groups, base_lrs):
                        group["lr"] = base * lr_at(global_step)
                history.losses.append(_step(model, optimizer, data, chunk, batch_size, after_backward, tracer))
                global_step += 1
                history.steps += 1
                bar.update(1)
                if time_budget is not None:
                    out_of_time = comm.bcast(time.perf_counter() - started >= time_budget, root=0)
                    if out_of_time:
                        break
            history.epoch_times.append(time.perf_counter() - began)
            if out_of_time:
                break
    finally:
        bar.close()
    return history


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
    chunk: np.ndarray,
    batch_size: int,
    after_backward: Callable[[], None] | None,
    tracer: Tracer,
) -> float:
    """One optimizer step on `chunk`, in batches; returns the mean loss over the chunk."""
    micro = [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    total = 0.0
    for j, idx in enumerate(micro):
        last = j == len(micro) - 1
        no_sync = getattr(model, "no_sync", None)
        quiet = contextlib.nullcontext() if last or no_sync is None else no_sync()
        with tracer.span("data"):
            x, y = data[idx]
        with quiet:
            with tracer.span("forward"):
                loss = squared_error(model(x), y).sum() / len(chunk)
            with tracer.span("backward"):
                loss.backward()
        total += loss.item()
    if after_backward is not None:
        with tracer.span("allreduce"):
            after_backward()
    with tracer.span("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def evaluate(model: nn.Module, data: Any, comm: MPI.Comm, batch_size: int = 2048) -> dict[str, Any]:
    """Mean squared error and R^2 per target over all of `data`, each rank taking one block.

    Ranks add up sums (squared errors, targets, squared targets, counts), so blocks of
    different lengths are fine. R^2 = 1 - SSE/SST: 1 is perfect, 0 is predicting the mean.
    """
    block = eval_shard(len(data), comm.Get_rank(), comm.Get_size())
    was_training = model.training
    model.eval()
    outputs = data[np.arange(1)][1].shape[1]
    sums = np.zeros((4, outputs))
    for start in range(block.start, block.stop, batch_size):
        x, y = data[np.arange(start, min(start + batch_size, block.stop))]
        y, error = y.double(), (model(x).double() - y.double()) ** 2
        part = torch.stack([error.sum(0), y.sum(0), (y * y).sum(0), torch.full_like(y[0], len(y))]).numpy()
        sums += part
    model.train(was_training)
    comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
    sse, total, squares, count = sums
    sst = squares - total**2 / count
    r2 = 1.0 - sse / sst
    return {"mse": float(sse.sum() / count[0]), "r2": r2.tolist(), "score": float(r2.mean())}

"""Lab 12's experiments, run on every engine: training under each shuffling strategy, and at equal wall-clock.

- `train_shuffled`: data-parallel training of the lab-04 MLP, with BatchNorm (statistics
  per rank, as in PyTorch DDP without SyncBatchNorm; or, as controls, statistics summed
  over ranks, or no BatchNorm), on the file-backed non-IID data set, under one strategy;
  validation loss and the bytes each source gave per epoch.
- `SyncedBatchNorm1d`: BatchNorm whose batch statistics are those of the ranks' batches
  together (what torch's SyncBatchNorm computes, here over an MPI communicator).
- `train_for_seconds`: the same network trained for a fixed wall-clock budget at a
  given global batch size and learning rate; how many epochs that bought, and the loss.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from mpi4py import MPI

from ..data.curves import StressStrainCurves
from ..data.sharding import epoch_permutation
from ..data_parallel import average_gradients, broadcast_parameters, evaluate, squared_error
from ..models.mlp import make_mlp
from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from ..tensor_parallel.conjugates import Copy, Reduce
from .shuffler import Shuffler
from .storage import stage

BATCH_NORMS = ("rank", "synced", "none")


class SyncedBatchNorm1d(torch.nn.BatchNorm1d):
    """BatchNorm1d normalising with the mean and variance of every rank's batch together.

    In training, each rank sums its batch's x and x^2 per feature and the sums are added over
    `comm` (forward an allreduce; backward an allreduce too, since every rank's loss depends on
    every rank's batch: `Reduce` after `Copy`, lab 14's conjugate pair). Batches may differ in
    size between ranks. In evaluation it uses the running statistics, as BatchNorm1d does.
    """

    def __init__(self, features: int, comm: Comm):
        super().__init__(features)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        count = torch.full((1, x.shape[1]), float(x.shape[0]), dtype=x.dtype)
        local = torch.cat([count, x.sum(0, keepdim=True), (x * x).sum(0, keepdim=True)])
        total = Reduce.apply(Copy.apply(local, self.comm), self.comm)
        n = total[0, 0].detach()
        mean = total[1] / n
        var = total[2] / n - mean * mean
        with torch.no_grad():  # running statistics as BatchNorm1d keeps them (unbiased variance)
            momentum = cast(float, self.momentum)
            cast(torch.Tensor, self.num_batches_tracked).add_(1)
            cast(torch.Tensor, self.running_mean).lerp_(mean, momentum)
            cast(torch.Tensor, self.running_var).lerp_(var * n / (n - 1), momentum)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def synchronise_batch_norm(model: torch.nn.Sequential, comm: Comm) -> torch.nn.Sequential:
    """Replace every BatchNorm1d of `model` by a SyncedBatchNorm1d with the same parameters (in place)."""
    for name, layer in model.named_children():
        if isinstance(layer, torch.nn.BatchNorm1d):
            synced = SyncedBatchNorm1d(layer.num_features, comm).to(layer.weight.dtype)
            synced.load_state_dict(layer.state_dict())
            setattr(model, name, synced)
    return model


def average_buffers(model: torch.nn.Module, comm: MPI.Comm) -> None:
    """Replace BatchNorm's running statistics by their mean over ranks (before evaluating)."""
    for buffer in model.buffers():
        if buffer.dtype.is_floating_point:
            values = buffer.numpy()
            comm.Allreduce(MPI.IN_PLACE, values, op=MPI.SUM)
            values /= comm.Get_size()


def train_shuffled(
    comm: MPI.Comm,
    root: Path | str,
    strategy: str,
    q: float = 0.0,
    *,
    epochs: int = 8,
    batch_size: int = 32,
    lr: float = 0.02,
    validation: int = 1024,
    seed: int = 0,
    batch_norm: str = "rank",
) -> dict[str, Any]:
    """Train on the store at `root` with one strategy; per epoch: validation MSE and bytes summed over ranks.

    batch_norm: "rank" (statistics of each rank's batch), "synced" (of all ranks' batches
    together, `SyncedBatchNorm1d`) or "none" (no BatchNorm layers).

    batch_size is per rank; every rank takes floor(smallest partition / batch_size)
    steps per epoch, so that all take the same number. The learning rate decays
    linearly to zero over the run, so that the last epoch's loss is not a lucky or
    unlucky step of a noisy curve. Validation samples come from
    another seed of the same generator (IID, in memory).
    """
    if batch_norm not in BATCH_NORMS:
        raise ValueError(f"batch_norm must be one of {BATCH_NORMS}, not {batch_norm!r}")
    torch.manual_seed(seed)
    shared, local = stage(comm, Path(root))
    shuffler = Shuffler(comm, shared, local, strategy, q, seed)
    model = make_mlp(seed, batch_norm=batch_norm != "none")
    if batch_norm == "synced":
        synchronise_batch_norm(model, comm)
    broadcast_parameters(model, comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    held_out = StressStrainCurves(validation, seed=seed + 1000)
    steps = min(shuffler.counts) // batch_size
    if steps < 1:
        raise ValueError(
            f"batch_size {batch_size} per rank is larger than the smallest partition ({min(shuffler.counts)})"
        )
    losses = []
    for epoch in range(epochs):
        order = shuffler.start_epoch(epoch)
        model.train()
        for k in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr * (1 - (epoch * steps + k) / (epochs * steps))
            x, y = shuffler.read(order[k * batch_size : (k + 1) * batch_size])
            loss = squared_error(model(torch.from_numpy(x)), torch.from_numpy(y)).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients(model, comm)
            optimizer.step()
        average_buffers(model, comm)
        losses.append(evaluate(model, held_out, comm)["mse"])
    moved = np.array([[c.shared, c.local, c.exchanged] for c in shuffler.counters], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, moved, op=MPI.SUM)
    return {
        "val_loss": losses,
        "shared": moved[:, 0].tolist(),
        "local": moved[:, 1].tolist(),
        "exchanged": moved[:, 2].tolist(),
    }


def train_for_seconds(
    comm: MPI.Comm,
    seconds: float,
    global_batch: int,
    lr: float,
    *,
    n: int = 4096,
    validation: int = 1024,
    seed: int = 0,
) -> dict[str, Any]:
    """Train for `seconds` of wall-clock (rank 0's clock decides, every step) with global shuffling.

    The data set is made in memory first (not timed; kept for the next call). Returns the epochs done (a
    fraction), the seconds per epoch, the steps taken and the validation MSE at the end.
    """
    size = comm.Get_size()
    if global_batch % size:
        raise ValueError(f"the global batch ({global_batch}) must be a multiple of the ranks ({size})")
    torch.manual_seed(seed)
    x_all, y_all = _in_memory(n, seed)
    model = make_mlp(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    steps_per_epoch = n // global_batch
    comm.Barrier()
    began, steps, stop = time.perf_counter(), 0, False
    while not stop:
        epoch, k = divmod(steps, steps_per_epoch)
        mine = epoch_permutation(n, epoch, seed)[k * global_batch : (k + 1) * global_batch]
        block = block_range(global_batch, comm.Get_rank(), size)
        idx = torch.from_numpy(mine[block.start : block.stop])
        loss = squared_error(model(x_all[idx]), y_all[idx]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(model, comm)
        optimizer.step()
        steps += 1
        stop = comm.bcast(time.perf_counter() - began >= seconds, root=0)
    elapsed = comm.bcast(time.perf_counter() - began, root=0)
    mse = evaluate(model, StressStrainCurves(validation, seed=seed + 1000), comm)["mse"]
    epochs = steps / steps_per_epoch
    return {
        "global_batch": global_batch,
        "lr": lr,
        "steps": steps,
        "epochs": epochs,
        "epoch_time": elapsed / epochs,
        "val_loss": mse if np.isfinite(mse) else float("nan"),
    }


@functools.lru_cache(maxsize=2)
def _in_memory(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return StressStrainCurves(n, seed=seed)[np.arange(n)]

"""Lab 05's experiments at equal wall-clock time, and MPI's allreduce against torch.distributed's.

- `train_for_time`: the lab's MLP trained with `DataParallel` for a fixed wall-clock
  budget at one global batch size, scored on held-out tests after every epoch (the
  clock stopped meanwhile), every allreduce counted: time-to-accuracy curves, and the
  synchronisations per epoch measured against the formula `syncs_per_epoch`.
- `allreduce_vs_gloo`: the same float32 arrays summed by the MPI library's `Allreduce`
  and by torch.distributed's gloo backend, taking turns, time per size.

Call both on every rank of the communicator at once.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI


class AllreduceCounter(MPI.Intracomm):
    """The same communicator (not a copy), counting the allreduces called on it."""

    def __init__(self, comm: MPI.Intracomm):
        self.allreduces = 0

    def Allreduce(self, *args: Any, **kwargs: Any) -> None:  # noqa: N802 (MPI's name)
        self.allreduces += 1
        super().Allreduce(*args, **kwargs)

    def Iallreduce(self, *args: Any, **kwargs: Any) -> MPI.Request:  # noqa: N802 (MPI's name)
        self.allreduces += 1
        return super().Iallreduce(*args, **kwargs)


def syncs_per_epoch(n: int, global_batch: int, ranks: int) -> int:
    """Gradient synchronisations per epoch = batches per epoch: each rank's ceil(n/P) samples in batches of B/P."""
    shard = -(-n // ranks)
    return -(-shard // (global_batch // ranks))


def train_for_time(
    comm: MPI.Intracomm,
    seconds: float,
    global_batch: int,
    lr: float = 0.003,
    *,
    n: int = 4096,
    test: int = 1024,
    threads: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Train the lab's MLP (SGD with momentum) for `seconds` of training wall-clock at one global batch.

    After every epoch, and when the budget is spent, the model is scored (R^2) on `test`
    held-out samples with the training clock stopped. Returns `times` and `scores` (from
    (0, the untrained score) on), the allreduce calls of each full epoch and of the whole
    run, steps, epochs (a fraction), seconds per epoch (training time / epochs) and the
    final MSE.
    `threads` sets torch's threads for the run (a single rank may use every core).
    """
    import torch

    from ..data import StressStrainCurves
    from ..data_parallel import DataParallel, evaluate, threads_per_rank, train
    from ..models.mlp import make_mlp

    size = comm.Get_size()
    if seconds <= 0:
        raise ValueError(f"the budget must be a positive number of seconds, got {seconds}")
    if global_batch % size:
        raise ValueError(f"the global batch ({global_batch}) must be a multiple of the ranks ({size})")
    before = threads_per_rank()
    torch.set_num_threads(threads or before)
    counted = AllreduceCounter(comm)
    train_data, test_data = StressStrainCurves(n, seed=seed), StressStrainCurves(test, seed=seed + 1)
    model = DataParallel(make_mlp(seed=seed), counted)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    times, scores = [0.0], [evaluate(model, test_data, comm)["score"]]
    allreduces, steps, epoch = [], 0, 0
    try:
        while times[-1] < seconds:
            calls = counted.allreduces
            history = train(
                model,
                optimizer,
                train_data,
                comm,
                epochs=epoch + 1,
                start_epoch=epoch,
                batch_size=global_batch // size,
                seed=seed,
                progress=False,
                time_budget=seconds - times[-1],
            )
            if history.steps == syncs_per_epoch(n, global_batch, size):  # a full epoch
                allreduces.append(counted.allreduces - calls)
            steps += history.steps
            epoch += 1
            times.append(times[-1] + comm.bcast(history.epoch_times[0], root=0))
            result = evaluate(model, test_data, comm)
            scores.append(result["score"])
    finally:
        model.remove_hooks()
        torch.set_num_threads(before)
    epochs = steps / syncs_per_epoch(n, global_batch, size)
    return {
        "global_batch": global_batch,
        "ranks": size,
        "lr": lr,
        "times": times,
        "scores": scores,
        "allreduces": allreduces,
        "allreduces_total": counted.allreduces,
        "steps": steps,
        "epochs": epochs,
        "epoch_time": times[-1] / epochs,
        "mse": result["mse"],
    }


def time_to_score(times: Sequence[float], scores: Sequence[float], target: float) -> float | None:
    """The first time at which a run's score reached `target` (None if it never did)."""
    return next((t for t, s in zip(times, scores) if s >= target), None)


def allreduce_vs_gloo(comm: MPI.Intracomm, sizes: Sequence[int], repeats: int = 5) -> dict[str, list[float]]:
    """Seconds to sum float32 arrays of `sizes` bytes over all ranks: MPI's Allreduce and gloo's all_reduce.

    Starts gloo on the MPI ranks (`ddlab.data_parallel.init_gloo`). The two take turns at
    every size and repeat, the first repeat only warms up; each repeat counts its slowest
    rank and the fastest repeat is kept (load from other programs only adds time).
    """
    import torch
    import torch.distributed as dist

    from ..data_parallel import init_gloo

    init_gloo(comm)
    out: dict[str, list[float]] = {"MPI Allreduce": [], "gloo all_reduce": []}
    for nbytes in sizes:
        x = np.ones(max(nbytes // 4, 1), dtype=np.float32)
        tensor = torch.from_numpy(x)  # the same memory
        ops = {
            "MPI Allreduce": lambda x=x: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
            "gloo all_reduce": lambda tensor=tensor: dist.all_reduce(tensor),
        }
        samples: dict[str, list[float]] = {name: [] for name in ops}
        for repeat in range(repeats + 1):
            for name, op in ops.items() if repeat % 2 else reversed(ops.items()):
                comm.Barrier()
                began = time.perf_counter()
                op()
                elapsed = comm.allreduce(time.perf_counter() - began, op=MPI.MAX)
                if repeat:
                    samples[name].append(elapsed)
        for name, values in samples.items():
            out[name].append(float(np.min(values)))
    return out

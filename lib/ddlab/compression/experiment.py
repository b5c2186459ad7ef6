"""Lab 04's trainer with a compressed allreduce: the test loss after some steps, bytes and time per step.

`train_compressed(comm, reduce, steps)` trains lab 04's MLP (SGD with momentum 0.9, batches of 32 per rank; the
proofs for error feedback, Stich et al., NeurIPS 2018 and Karimireddy et al., ICML 2019, are for SGD without
momentum, and Deep Gradient Compression, Lin et al., ICLR 2018, needed momentum correction, local clipping,
momentum-factor masking and warm-up to keep accuracy with momentum: none of them is here)
for `steps` steps of one epoch with `reduce` as DataParallel's allreduce, the same data
and start for every method, and reports what the notebook and bench/compression.py plot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mpi4py import MPI

from ..data import StressStrainCurves
from ..data_parallel import DataParallel, evaluate, train
from ..models import make_mlp
from .allreducers import CompressedAllreduce

BATCH = 32


@dataclass(frozen=True)
class TrainingRun:
    """One method's run: test mean squared error at the end, bytes each rank sent per step, seconds per step."""

    method: str
    density: float
    feedback: bool
    loss: float
    bytes_per_step: float
    seconds_per_step: float


def train_compressed(
    comm: MPI.Comm, reduce: CompressedAllreduce, steps: int, lr: float = 0.05, seed: int = 0
) -> TrainingRun:
    """Train lab 04's MLP for `steps` steps with `reduce` as the allreduce; evaluate on held-out curves."""
    size = comm.Get_size()
    data = StressStrainCurves(n=size * BATCH * steps, seed=seed)
    test = StressStrainCurves(n=1024, seed=seed + 1)
    model = DataParallel(make_mlp(seed=seed), comm, allreduce=reduce)
    history = train(
        model,
        torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        data,
        comm,
        batch_size=BATCH,
        max_steps=steps,
        seed=seed,
        progress=False,
    )
    model.remove_hooks()
    return TrainingRun(
        reduce.method,
        reduce.density,
        reduce.feedback,
        evaluate(model, test, comm)["mse"],
        reduce.bytes_sent / max(reduce.calls, 1),
        history.step_time(),
    )

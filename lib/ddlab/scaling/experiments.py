"""Scaling experiments (lab 05): speedup, efficiency, where a step's time goes, batch and LR scaling.

- Strong scaling keeps the global problem fixed (the global batch) and adds ranks:
  speedup S(P) = T(1) / T(P), efficiency E(P) = S(P) / P.
- Weak scaling keeps the work per rank fixed (the per-rank batch): the ideal step time
  stays constant, efficiency E(P) = T(1) / T(P).

`measure_training` runs on every engine (through `rc[:].apply_sync`) and returns the
step time, the time per phase of each rank, and its trace. Allreduce timings for the
fusion study (k allreduces of n/k bytes against one of n) and learning-rate rules for
large batches (linear with warm-up, Goyal et al. 2017; square root, Krizhevsky 2014)
are here too.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from ..runtime.reference import reference

RULES = ("none", "linear", "sqrt")


def speedup(t1: float, tp: float) -> float:
    """Strong-scaling speedup: how many times faster P ranks finish the same work."""
    return t1 / tp


@reference("scaling_efficiency")
def efficiency(t1: float, tp: float, p: int, weak: bool = False) -> float:
    """Share of ideal: T(1)/(P T(P)) for strong scaling, T(1)/T(P) for weak scaling."""
    return t1 / tp if weak else t1 / (p * tp)


def fused_ratio(k: float | np.ndarray, nbytes: float, alpha: float, beta: float) -> float | np.ndarray:
    """Time of k allreduces of n/k bytes over one of n bytes: (k alpha + n beta) / (alpha + n beta)."""
    return (k * alpha + nbytes * beta) / (alpha + nbytes * beta)


@reference("lr_factor")
def lr_factor(step: int, k: float, rule: str = "linear", warmup_steps: int = 0) -> float:
    """Multiplier of the base learning rate at `step` when the batch grows k times.

    rule: "none" (1), "linear" (k; Goyal et al., "Accurate, Large Minibatch SGD: Training
    ImageNet in 1 Hour", 2017), "sqrt" (sqrt k; Krizhevsky, "One weird trick for
    parallelizing convolutional neural networks", 2014). With warm-up the multiplier
    grows linearly from 1 at step 0 to the target at step `warmup_steps`, as Goyal et al.
    do over the first 5 epochs.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    target = {"none": 1.0, "linear": float(k), "sqrt": math.sqrt(k)}[rule]
    if warmup_steps > 0 and step < warmup_steps:
        return 1.0 + (target - 1.0) * step / warmup_steps
    return target


def _world() -> MPI.Comm:
    return MPI.COMM_WORLD


def measure_training(
    per_rank_batch: int,
    steps: int = 20,
    warmup: int = 5,
    bucket_cap_mb: float | None = 25.0,
    overlap: bool = True,
    allreduce: Any = None,
    n: int = 100_000,
    hidden: tuple[int, ...] | None = None,
    seed: int = 0,
    comm: MPI.Comm | None = None,
) -> dict[str, Any]:
    """Train the lab's MLP for `steps` timed steps on every rank; call it on all ranks at once.

    Returns, for this rank: the wall-clock seconds per step (the same on all ranks, which
    end together), seconds per step of each phase (data, forward, backward, allreduce
    waits, optimizer), and the spans of the timed steps for a trace.
    """
    import torch

    from ..data import StressStrainCurves
    from ..data_parallel import DataParallel, threads_per_rank, train
    from ..models.mlp import HIDDEN, make_mlp
    from ..runtime.trace import Tracer

    comm = comm or _world()
    threads = threads_per_rank()
    tracer = Tracer(comm.Get_rank())
    model = DataParallel(
        make_mlp(seed=seed, hidden=hidden or HIDDEN),
        comm,
        allreduce=allreduce,
        bucket_cap_mb=bucket_cap_mb,
        overlap=overlap,
        tracer=tracer,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = StressStrainCurves(n=n, seed=seed)
    train(model, optimizer, data, comm, batch_size=per_rank_batch, max_steps=warmup, progress=False)
    tracer.align(comm)
    began = time.perf_counter()
    train(
        model, optimizer, data, comm, batch_size=per_rank_batch, max_steps=steps, seed=1, tracer=tracer, progress=False
    )
    comm.Barrier()
    seconds = (time.perf_counter() - began) / steps
    return {
        "rank": comm.Get_rank(),
        "size": comm.Get_size(),
        "threads": threads,
        "step_time": seconds,
        "phases": {name: total / steps for name, total in tracer.totals().items()},
        "spans": tracer.spans,
    }


def time_pieces(
    comm: MPI.Comm, n_elements: int, pieces: Sequence[int], repeats: int = 10, allreduce: Callable | None = None
) -> dict[int, float]:
    """Seconds to allreduce n float32 elements as k equal pieces, one after another, per k.

    A collective call; every rank gets the same numbers (each repeat counts its slowest
    rank). The k values take turns in every repeat, so machine load hits them alike, and
    the fastest repeat is kept: load from other programs only ever adds time, so the
    minimum is the best estimate of what the operation itself costs.
    """
    if allreduce is None:

        def allreduce(c: MPI.Comm, x: np.ndarray) -> None:
            c.Allreduce(MPI.IN_PLACE, x)

    data = np.ones(n_elements, dtype=np.float32)
    splits = {k: np.array_split(data, k) for k in pieces}
    samples: dict[int, list[float]] = {k: [] for k in pieces}
    for repeat in range(repeats + 1):
        for k, parts in splits.items():
            comm.Barrier()
            began = MPI.Wtime()
            for part in parts:
                allreduce(comm, part)
            elapsed = comm.allreduce(MPI.Wtime() - began, op=MPI.MAX)
            if repeat:  # the first round only warms up
                samples[k].append(elapsed)
    return {k: float(np.min(v)) for k, v in samples.items()}


def fit_allreduce(comm: MPI.Comm, sizes: Sequence[int] | None = None, repeats: int = 10) -> tuple[float, float]:
    """Alpha (seconds per call) and beta (seconds per byte) of MPI's Allreduce on this communicator."""
    from ..p2p import fit_alpha_beta

    sizes = list(sizes or [2**k for k in range(4, 23, 2)])  # 16 B .. 4 MiB
    seconds = []
    for nbytes in sizes:
        times = time_pieces(comm, max(nbytes // 4, 1), [1], repeats)
        seconds.append(times[1])
    return fit_alpha_beta(sizes, seconds)

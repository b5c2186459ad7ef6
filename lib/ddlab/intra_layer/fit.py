"""Which image sides train under a per-rank memory budget: lab 06's splits against lab 08's strategies.

Every configuration trains two steps (SGD with momentum, a batch of two) under the
same `Ledger` budget as lab 06, so the largest sides are exact and deterministic.
A rank that runs out of memory tells the others (through `CountingComm`'s failure
notices), so they stop waiting for its halos instead of timing out.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from mpi4py import MPI

from ..data.images import make_segmentation
from ..model_parallel import Fit, fit_sweep, largest_sides
from ..model_parallel.timeline import polite_barrier
from ..models.unet import UNet
from ..runtime.counting import CountingComm
from ..runtime.memory import Ledger
from ..runtime.waiting import PeerFailed
from .filter_unet import FilterUNet, filter_step
from .hybrid import group_samples, make_grid
from .spatial import SpatialUNet, spatial_step

STRATEGIES = ("spatial", "hybrid", "filter")
COLUMNS = ("one process", "naive", "balanced", *STRATEGIES)
COLLECTIVES = ("Allreduce", "Allgather", "Allgatherv")  # what the strategies call besides halo messages


def _build(
    strategy: str, model: UNet, comm: MPI.Comm, side: int, timeout: float, images: torch.Tensor, masks: torch.Tensor
) -> tuple[Any, Callable, list[Any]]:
    """The strategy's network on this rank, its step function, and the communicators it uses."""
    if strategy == "filter":
        counting = CountingComm(comm, timeout, COLLECTIVES)
        split = FilterUNet(model, counting)
        return split, lambda opt: filter_step(split, images, masks, opt), [counting]
    if strategy == "spatial":
        counting = CountingComm(comm, timeout, COLLECTIVES)
        net = SpatialUNet(model, counting, side)
        return net.model, lambda opt: spatial_step(net, images, masks, opt), [counting]
    if strategy == "hybrid":
        grid = make_grid(comm, 2 if comm.Get_size() % 2 == 0 else 1)
        spatial, data = CountingComm(grid.spatial, timeout, COLLECTIVES), CountingComm(grid.data, timeout, COLLECTIVES)
        net = SpatialUNet(model, spatial, side)
        mine = group_samples(images.shape[0], grid)
        return net.model, lambda opt: spatial_step(net, images[mine], masks[mine], opt, data_comm=data), [spatial, data]
    raise ValueError(f"no strategy {strategy!r}: choose one of {STRATEGIES}")


def try_strategy(
    comm: MPI.Comm,
    model: UNet,
    side: int,
    strategy: str,
    *,
    budget: int | None,
    batch: int = 2,
    steps: int = 2,
    seed: int = 0,
    timeout: float = 60.0,
) -> Fit:
    """Train `steps` steps of model with `strategy` over comm's ranks under the budget; a collective over comm.

    The time per sample is the last step's; peaks are every rank's Ledger.report().
    """
    own = comm.Dup()  # messages a failed step leaves behind die with it
    images, masks = make_segmentation(batch, side, seed, dtype=next(model.parameters()).dtype)
    ledger = Ledger(budget, stage=f"rank {comm.Get_rank()} of {comm.Get_size()} ({strategy})")
    problem, seconds, comms = None, None, list[Any]()
    try:
        module, step, comms = _build(strategy, model, own, side, timeout, images, masks)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
        ledger.watch(module, optimizer)
        for _ in range(steps):
            polite_barrier(own)
            start = time.perf_counter()
            with ledger.activations():
                step(optimizer)
            seconds = (max(own.allgather(time.perf_counter())) - start) / batch
    except Exception as err:  # out of memory here, or a peer's failure: stop every rank
        if not isinstance(err, PeerFailed):
            problem = f"{type(err).__name__}: {err}"
        for counting in comms:
            counting.fail_all(problem or "a peer failed")
    ledger.close()
    problems = own.allgather(problem)
    for counting in comms:
        counting.free()
        if counting.comm is not own:
            counting.comm.Free()  # the hybrid grid's sub-communicators
    own.Free()
    error = next((p for p in problems if p), None)
    return Fit(strategy, side, [], None if error else seconds, comm.allgather(ledger.report()), error)


def intra_sweep(
    comm: MPI.Comm, model: UNet, sides: list[int], budget: int, batch: int = 2, steps: int = 2
) -> list[Fit]:
    """For each side, lab 06's three columns (`fit_sweep`) and lab 08's strategies. Same list on every rank."""
    results = []
    for side in sides:
        results += fit_sweep(comm, model, [side], budget, batch, steps)
        results += [try_strategy(comm, model, side, s, budget=budget, batch=batch, steps=steps) for s in STRATEGIES]
    return results


def markdown_table(results: list[Fit], columns: tuple[str, ...] = COLUMNS) -> str:
    """Sides down, configurations across, each cell ms per sample or OOM; the largest side of each last."""
    by = {(r.split, r.side): r for r in results}
    lines = ["| side | " + " | ".join(columns) + " |", "|---:|" + "---:|" * len(columns)]
    for side in sorted({r.side for r in results}):
        times = [by[c, side].seconds_per_sample for c in columns]
        cells = ["OOM" if t is None else f"{t * 1e3:.0f}" for t in times]
        lines.append(f"| {side} | " + " | ".join(cells) + " |")
    largest = largest_sides(results, columns)
    lines.append("| largest | " + " | ".join(str(largest[c]) for c in columns) + " |")
    return "\n".join(lines)


def halo_share(comm: MPI.Comm, model: UNet, side: int, batch: int = 2) -> tuple[int, int]:
    """(halo bytes this rank sends in one spatial step, forward and backward; its peak activation bytes)."""
    counting = CountingComm(comm, allow=COLLECTIVES)
    images, masks = make_segmentation(batch, side, 0, dtype=next(model.parameters()).dtype)
    net, ledger = SpatialUNet(model, counting, side), Ledger()
    with ledger.activations():
        spatial_step(net, images, masks)
    counting.free()
    return counting.traffic.bytes_sent, ledger.report()["activations"]

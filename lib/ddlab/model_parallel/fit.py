"""Which image sizes fit: training steps per image side and split, under a per-rank memory budget.

For each side, one process runs the whole UNet alone, and the ranks run it split
naively (equal layers) and balanced by measured memory per layer. A configuration
fits if no rank raises `OutOfMemory`; its time per sample and every rank's peak
bytes are recorded either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from mpi4py import MPI

from ..data.images import make_segmentation
from ..models.unet import UNet
from ..runtime.comm import Comm
from ..runtime.counting import underlying
from ..runtime.memory import Ledger
from .profile import profile_layers
from .splits import balanced_split, naive_split
from .stage import Stage, attempt, train_step
from .timeline import polite_barrier
from .ushape import Piece, PieceStage

SPLITS = ("one process", "naive", "balanced")


@dataclass
class Fit:
    """One configuration at one image side: did a training step fit, how fast, how much memory."""

    split: str
    side: int
    bounds: list[int] | list[Piece]
    seconds_per_sample: float | None  # None when it did not fit
    peaks: list[dict[str, int]] = field(default_factory=list)  # per rank: Ledger.report()
    error: str | None = None  # the first rank's error (an OutOfMemory message), if any

    @property
    def fits(self) -> bool:
        return self.error is None

    @property
    def peak_per_rank(self) -> list[int]:
        return [p["peak"] for p in self.peaks]


def memory_costs(model: UNet, side: int, batch: int, state_copies: int = 1, seed: int = 0) -> list[int]:
    """Measured bytes per layer for a batch of this side: parameters, gradients, optimizer state, activations."""
    images, masks = make_segmentation(batch, side, seed, dtype=next(model.parameters()).dtype)
    return [cost.memory(state_copies) for cost in profile_layers(model, images, masks)]


def try_split(
    comm: Comm,
    model: UNet,
    bounds: list[int] | list[Piece],
    side: int,
    split: str,
    *,
    budget: int | None,
    batch: int = 2,
    steps: int = 2,
    seed: int = 0,
) -> Fit:
    """Train `steps` steps (SGD with momentum) of model cut at bounds (or as pieces) over comm's ranks, under the budget.

    The time per sample is the last step's (the first one also allocates
    gradients and optimizer state). A collective over comm.
    """
    raw = underlying(comm)
    images, masks = make_segmentation(batch, side, seed, dtype=next(model.parameters()).dtype)
    ledger = Ledger(budget, stage=f"stage {raw.Get_rank()} of {raw.Get_size()}")
    shape = (images.shape[1], side, side)
    stage: Stage | PieceStage
    if all(isinstance(b, Piece) for b in bounds):
        stage = PieceStage(model, [b for b in bounds if isinstance(b, Piece)], comm, shape, ledger=ledger)
    else:
        stage = Stage(model, [b for b in bounds if isinstance(b, int)], comm, shape, ledger=ledger)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.01, momentum=0.9)
    _, problems = attempt(stage, lambda: ledger.watch(stage.layers, optimizer))
    seconds = None
    for _ in range(steps if not any(problems) else 0):
        polite_barrier(raw)
        start = time.perf_counter()
        _, problems = attempt(stage, lambda: train_step(stage, images, masks, optimizer))
        ends = raw.allgather(time.perf_counter())
        seconds = (max(ends) - start) / batch
        if any(problems):
            break
    ledger.close()
    stage.mailbox.free()
    error = next((p for p in problems if p), None)
    return Fit(split, side, bounds, None if error else seconds, raw.allgather(ledger.report()), error)


def fit_sweep(comm: MPI.Comm, model: UNet, sides: list[int], budget: int, batch: int = 2, steps: int = 2) -> list[Fit]:
    """For each side: one process (on rank 0 alone), then naive and balanced splits over all ranks.

    The balanced split comes from rank 0's per-layer memory profile at that side.
    Returns the same list on every rank. A collective over comm.
    """
    n, k, results = len(model.layers), comm.Get_size(), []
    for side in sides:
        alone = None
        if comm.Get_rank() == 0:
            alone = try_split(MPI.COMM_SELF, model, [0, n], side, SPLITS[0], budget=budget, batch=batch, steps=steps)
            bounds = balanced_split(memory_costs(model, side, batch), k)
        polite_barrier(comm)
        alone, bounds = comm.bcast((alone, bounds if comm.Get_rank() == 0 else None), root=0)
        results.append(alone)
        for split, cut in ((SPLITS[1], naive_split(n, k)), (SPLITS[2], bounds)):
            results.append(try_split(comm, model, cut, side, split, budget=budget, batch=batch, steps=steps))
    return results


def largest_sides(results: list[Fit], splits: tuple[str, ...] = SPLITS) -> dict[str, int]:
    """The largest side each split trained at (0 if none)."""
    return {split: max((r.side for r in results if r.split == split and r.fits), default=0) for split in splits}


def fit_table(results: list[Fit], splits: tuple[str, ...] = SPLITS) -> str:
    """A text table: per side and split, time per sample and each rank's peak MiB, or OOM."""
    sides = sorted({r.side for r in results})
    by = {(r.split, r.side): r for r in results}
    width = 26
    lines = [
        f"{'side':>5} | " + " | ".join(f"{split:^{width}}" for split in splits),
        f"{'':>5} | " + " | ".join(f"{'ms/sample  peak MiB/rank':^{width}}" for _ in splits),
    ]
    lines.append("-" * len(lines[0]))
    for side in sides:
        cells = []
        for split in splits:
            r = by.get((split, side))
            if r is None:
                cells.append(" " * width)
                continue
            peaks = "/".join(f"{p / 2**20:.0f}" for p in r.peak_per_rank)
            time = "   OOM" if r.seconds_per_sample is None else f"{r.seconds_per_sample * 1e3:6.0f}"
            cells.append(f"{time}  {peaks:>{width - 8}}")
        lines.append(f"{side:>5} | " + " | ".join(cells))
    largest = largest_sides(results, splits)
    lines.append("largest side that fits: " + ", ".join(f"{split} {largest[split]}" for split in splits))
    return "\n".join(lines)


def first_error(results: list[Fit]) -> str | None:
    """The first out-of-memory (or other) message of a sweep, to show what OOM says."""
    return next((r.error for r in results if r.error), None)

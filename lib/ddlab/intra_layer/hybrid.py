"""Hybrid data x spatial parallelism: a grid of ranks, samples split along one axis, rows along the other.

P = D x S ranks form D groups of S. The S ranks of a group hold the slabs of the same
samples (the group's share of the batch) and exchange halos; the D ranks holding the same
slab in different groups hold different samples and average their gradients, as in lab 04.
Rank r sits in group r // S at slab r % S.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mpi4py import MPI

from ..runtime.blocks import block_range
from .spatial import SpatialUNet, spatial_step


@dataclass
class Grid:
    """This rank's two sub-communicators: `spatial` (its group's slabs), `data` (the same slab in every group)."""

    spatial: MPI.Comm
    data: MPI.Comm

    def free(self) -> None:
        self.spatial.Free()
        self.data.Free()


def make_grid(comm: MPI.Comm, data_ways: int) -> Grid:
    """Split comm's P ranks into data_ways groups of P / data_ways slabs. A collective over comm."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if data_ways < 1 or size % data_ways:
        raise ValueError(f"{size} ranks do not form {data_ways} equal groups: data_ways must divide the rank count")
    group, slab = divmod(rank, size // data_ways)
    return Grid(spatial=comm.Split(group, slab), data=comm.Split(slab, group))


def group_samples(batch: int, grid: Grid) -> slice:
    """The samples of a batch this rank's group trains on (the batch must split evenly over the groups)."""
    ways = grid.data.Get_size()
    if batch % ways:
        raise ValueError(f"a batch of {batch} does not split evenly over {ways} groups: use a multiple of {ways}")
    samples = block_range(batch, grid.data.Get_rank(), ways)
    return slice(samples.start, samples.stop)


def hybrid_step(
    net: SpatialUNet,
    grid: Grid,
    images: torch.Tensor,
    masks: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
) -> float:
    """One step of the whole batch: this group's samples, this rank's slab of them. Returns the mean loss.

    net must be a SpatialUNet over grid.spatial.
    """
    mine = group_samples(images.shape[0], grid)
    return spatial_step(net, images[mine], masks[mine], optimizer, data_comm=grid.data)

"""The three collectives tensor parallelism needs, on tensors, built from the ring's two halves.

An allreduce is a reduce-scatter followed by an allgather (lab 03's ring): that is what
lets sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models", MLSys 2023) take the two halves apart and put the LayerNorm
and dropout between them at no extra communication. All three use the ring halves
`reduce_scatter_ring` and `allgather_ring` (point-to-point messages, so a counting
communicator sees every byte): on t ranks each rank sends (t-1)/t of the tensor's bytes
per half, 2(t-1)/t per allreduce.

- `allreduce(comm, x)`: the sum over ranks, the same bits on every rank.
- `reduce_scatter(comm, x, dim)`: the sum over ranks of this rank's block of x along dim
  (blocks as `block_range`).
- `allgather(comm, x, dim, length)`: every rank's block, concatenated along dim (length in all).

The tensor's dtype travels as is (float64, float32, float16: NumPy must know it).
"""

from __future__ import annotations

import numpy as np
import torch

from ..allreduce import allgather_ring, reduce_scatter_ring
from ..runtime.blocks import block_bounds, block_range
from ..runtime.comm import Comm


def _flat(x: torch.Tensor) -> np.ndarray:
    return x.detach().contiguous().reshape(-1).numpy()


def allreduce(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """A new tensor: x summed over comm's ranks (reduce-scatter then allgather around the ring)."""
    if comm.Get_size() == 1:
        return x.detach().clone()
    flat = _flat(x)
    bounds = block_bounds(flat.size, comm.Get_size())
    total = allgather_ring(comm, reduce_scatter_ring(comm, flat, bounds), bounds)
    return torch.from_numpy(total).view(x.shape)


def reduce_scatter(comm: Comm, x: torch.Tensor, dim: int) -> torch.Tensor:
    """A new tensor: this rank's block of x along dim (block_range), summed over comm's ranks."""
    size, rank = comm.Get_size(), comm.Get_rank()
    front = x.detach().movedim(dim, 0)
    rows = block_range(front.shape[0], rank, size)
    if size == 1:
        return x.detach().clone()
    inner = int(np.prod(front.shape[1:]))
    mine = reduce_scatter_ring(comm, _flat(front), [b * inner for b in block_bounds(front.shape[0], size)])
    return torch.from_numpy(mine).view(len(rows), *front.shape[1:]).movedim(0, dim)


def allgather(comm: Comm, x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """A new tensor: every rank's block of a tensor `length` long along dim, in rank order (x is this rank's)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    front = x.detach().movedim(dim, 0)
    share = len(block_range(length, rank, size))
    if front.shape[0] != share:
        raise ValueError(
            f"this rank's block has {front.shape[0]} rows along dim {dim}, but its share of {length} "
            f"over {size} ranks is {share} (block_range)"
        )
    if size == 1:
        return x.detach().clone()
    inner = int(np.prod(front.shape[1:]))
    whole = allgather_ring(comm, _flat(front), [b * inner for b in block_bounds(length, size)])
    return torch.from_numpy(whole).view(length, *front.shape[1:]).movedim(0, dim)

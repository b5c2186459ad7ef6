"""Spatially parallel max pooling: the window crosses the slab's edge, so pooling needs halos too.

The UNet's 2x2 pooling stays inside a slab because its bounds are multiples of 2**depth.
ResNet's stem pooling does not: a 3x3 window with stride 2 and padding 1 (He et al.,
"Deep Residual Learning for Image Recognition", CVPR 2016, Table 1). With padding
p = k // 2, output row i reads input rows i*s - p to i*s + p and belongs to the rank
holding its centre row i*s. If every slab starts at a multiple of the stride s, a slab's
first window reaches p rows above it, and its last window reaches q = max(0, p + 1 - s)
rows below: the halos are unequal (1 and 0 for ResNet's stem pool, 2 and 1 for a 5x5
window with stride 2, 1 and 1 with stride 1), and a side of no rows sends no message.
Where there is no neighbour the rows are -inf, as one process's padding is for a max.

Backward, each output's gradient goes to the input element its window took the maximum
of; the gradient that lands on a halo row goes home to the rank that owns the row, which
adds it to its own rows' gradient (the windows of both ranks may have picked the same
element).

Exercise 8.4 signature: `SpatialMaxPool.apply(x, comm, kernel, stride) -> y`: x this rank's
slab (N, C, h, W) of an image split by rows in rank order, every slab starting at a multiple
of stride (the last may end anywhere) and at least as tall as the halos it lends; kernel odd.
y: this rank's rows of `F.max_pool2d(image, kernel, stride, kernel // 2)` on one process, the
output rows whose window centre lies in the slab. Messages: forward, the slab's last p rows to
rank+1 and, if q > 0, its first q rows to rank-1; backward, the halos' gradients home (p rows
to rank-1, q rows to rank+1); none of zero rows, none to a rank that does not exist.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..runtime.comm import Comm
from ..runtime.reference import reference
from .halo import exchange_rows

FORWARD_TAGS, BACKWARD_TAGS = (85, 86), (87, 88)  # (going up, going down)


def pool_halos(kernel: int, stride: int) -> tuple[int, int]:
    """Rows a slab's windows read above it and below it, between slabs that start at multiples of stride."""
    if kernel < 1 or kernel % 2 == 0 or stride < 1:
        raise ValueError(f"a spatial max pooling takes an odd kernel >= 1 and a stride >= 1, not {kernel} and {stride}")
    return kernel // 2, max(0, kernel // 2 + 1 - stride)


def _pad_rows(like: torch.Tensor, rows: int) -> torch.Tensor:
    """-inf rows shaped like `like`'s (N, C, *, W): the padding of a max."""
    return torch.full((like.shape[0], like.shape[1], max(rows, 0), like.shape[3]), -torch.inf, dtype=like.dtype)


class SpatialMaxPool(torch.autograd.Function):
    """Forward: my output rows, with the halo rows my windows read. Backward: the halos' gradients go home."""

    @staticmethod
    @reference("spatial_max_pool")
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, kernel: int, stride: int) -> torch.Tensor:
        p, q = pool_halos(kernel, stride)
        rank, size, h = comm.Get_rank(), comm.Get_size(), x.shape[2]
        last = rank == size - 1
        if not last and h % stride:
            raise ValueError(f"rank {rank}'s slab of {h} rows: every slab but the last must be a multiple of {stride}")
        if h < max(0 if last else p, q if rank else 0):
            raise ValueError(f"rank {rank}'s slab of {h} rows cannot lend halos of {p} and {q} rows: use fewer ranks")
        above, below = exchange_rows(comm, x[:, :, :q], x[:, :, h - p :], FORWARD_TAGS, (p, q))
        if last:  # the image's bottom: -inf as far as the last window reaches
            below = _pad_rows(x, (-(-h // stride) - 1) * stride + p + 1 - h)
        top = _pad_rows(x, p) if above is None else above
        padded = torch.cat([top, x.detach(), _pad_rows(x, 0) if below is None else below], dim=2)
        y, ctx.where = F.max_pool2d(padded, kernel, stride, padding=(0, p), return_indices=True)
        ctx.comm, ctx.halos, ctx.rows, ctx.padded = comm, (p, q), h, padded.shape
        return y

    @staticmethod
    @reference("spatial_max_pool")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (p, q), h, (n, c, rows, w) = ctx.halos, ctx.rows, ctx.padded
        # each output's gradient onto the element its window took (windows overlap: add)
        spread = grad.new_zeros(n, c, rows * w).scatter_add_(2, ctx.where.flatten(2), grad.flatten(2))
        spread = spread.view(n, c, rows, w)
        to_above, to_below = spread[:, :, :p], spread[:, :, p + h : p + h + q]
        from_above, from_below = exchange_rows(ctx.comm, to_above, to_below, BACKWARD_TAGS, (q, p))
        grad_x = spread[:, :, p : p + h].clone()
        if from_above is not None:
            grad_x[:, :, :q] += from_above
        if from_below is not None:
            grad_x[:, :, h - p :] += from_below
        return grad_x, None, None, None

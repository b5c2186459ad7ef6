"""Column- and row-parallel linear layers, made from a whole `nn.Linear` so they can be compared with it.

A linear layer y = x W^T + b (W of shape (out, in)) splits two ways (Shoeybi et al., 2019):

- column-parallel: rank r holds some output features (rows of W, entries of b); it needs
  the whole input and computes its features of the output. The input goes through `Copy`
  (f): its gradient is the sum of every rank's part.
- row-parallel: rank r holds some input features (columns of W) and only those features
  of the input; its product is a part of the whole output, summed by `Reduce` (g). The
  bias is whole on every rank and added once, after the sum: added before, it would be
  counted t times.

A column-parallel layer followed by a row-parallel one (the MLP, attention) keeps the
features split in between: one allreduce forward (g), one backward (f).

With sequence parallelism (Korthikanti et al., MLSys 2023), the input of a column-parallel
layer arrives as this rank's block of the sequence: `GatherLinear` allgathers it, and keeps
only the block for backward, allgathering it again there (their section 4.2.2: the
activation memory of the layer's input is divided by t, for one more allgather in backward).
A row-parallel layer's sum becomes a reduce-scatter to sequence blocks, and its bias, added
on a block, gets a gradient from that block only: `sequence_parallel_parameters` lists it.

Exercise 14.2 writes `ColumnParallelLinear(linear, rows, comm)` and `RowParallelLinear(linear, cols,
comm)` (without sequence parallelism): modules made from a whole `nn.Linear` that keep only this rank's
shard as `weight` and `bias` (rows and bias entries for column; columns and the whole bias for row);
`column_parallel_linear` and `row_parallel_linear` are the same computations on given shards. Exercise
14.5 writes `GatherLinear`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.comm import Comm
from ..runtime.reference import reference
from .collectives import allgather, reduce_scatter
from .conjugates import SEQUENCE, Copy, Reduce, ReduceScatter


@reference("parallel_linear")
def column_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm
) -> torch.Tensor:
    """This rank's output features of a linear layer whose rows of W (and entries of b) it holds."""
    return F.linear(Copy.apply(x, comm), weight, bias)


@reference("parallel_linear")
def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm) -> torch.Tensor:
    """The whole output of a linear layer whose columns of W this rank holds (x: those input features)."""
    y = Reduce.apply(F.linear(x, weight), comm)
    return y if bias is None else y + bias


class GatherLinear(torch.autograd.Function):
    """Sequence parallel column-parallel linear: allgather the sequence, multiply; keep only the block."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm, length: int
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.length, ctx.has_bias = comm, length, bias is not None
        return F.linear(allgather(comm, x, SEQUENCE, length), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        whole = allgather(ctx.comm, x, SEQUENCE, ctx.length)  # again: only the block was kept
        grad_x = reduce_scatter(ctx.comm, grad @ weight, SEQUENCE)
        grad_weight = grad.reshape(-1, grad.shape[-1]).T @ whole.reshape(-1, whole.shape[-1])
        grad_bias = grad.sum(dim=(0, 1)) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None


@reference("parallel_linear")
class ColumnParallelLinear(nn.Module):
    """Output features `rows` (an index tensor) of a whole linear layer; copies of its weights."""

    def __init__(self, linear: nn.Linear, rows: torch.Tensor, comm: Comm, sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.sequence_parallel, self.rows = comm, sequence_parallel, rows
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())

    def forward(self, x: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """x: the whole input, or with sequence parallelism this rank's block of a sequence `length` long."""
        if not self.sequence_parallel:
            return column_parallel_linear(x, self.weight, self.bias, self.comm)
        if length is None:
            raise ValueError("a sequence-parallel layer needs the whole sequence's length")
        return GatherLinear.apply(x, self.weight, self.bias, self.comm, length)


@reference("parallel_linear")
class RowParallelLinear(nn.Module):
    """Input features `cols` (an index tensor) of a whole linear layer, and its whole bias; copies."""

    def __init__(self, linear: nn.Linear, cols: torch.Tensor, comm: Comm, sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.sequence_parallel, self.cols = comm, sequence_parallel, cols
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: this rank's input features; the whole output, or with sequence parallelism this rank's block."""
        if not self.sequence_parallel:
            return row_parallel_linear(x, self.weight, self.bias, self.comm)
        y = ReduceScatter.apply(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias

"""Filter and channel parallelism: a convolution's weights split by output or by input channels.

Filter parallel: rank r owns output channels block_range(Cout, r, P) (its rows of the
weight and bias) and sees the whole input. Forward, it computes its channels and an
allgather assembles the whole output on every rank. Backward, its channels' gradient
gives its weights' gradient, and a partial input gradient (through its channels
only): the input's gradient is the sum of the partials, an allreduce; none where the
input wants no gradient (a first layer on the data: `ctx.needs_input_grad`).

Channel parallel: rank r owns input channels block_range(Cin, r, P) (its columns of the
weight) and only those channels of the input. Forward, its partial output (the
contribution of its channels) is summed over ranks by an allreduce, then the bias is
added. Backward sends no message: the output's gradient is the same on every rank, and
the gradient of the rank's own input channels is all it returns. That suffices when the
rank's input slice is all there is before the layer (the data, or the slice a
filter-parallel layer kept). Where every rank holds the whole input and cuts its
channels out of it, the layers before need the whole input gradient: an allgather
(the backward of that cut), which lab 09's oracle charges and this layer leaves out.

Both layers take the output's gradient to be the same on every rank (the layers after
run whole everywhere), so the backward of the filter layer's allgather is a slice; with
different partial gradients on the ranks it would be a reduce-scatter.

A filter-parallel layer followed by a channel-parallel one with the same split
(Megatron-LM's column-then-row pairing: Shoeybi et al., "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", arXiv 2019) needs no
message between them: the filter layer's output slice is the channel layer's input, and
the pair costs one allreduce forward and one backward. FilterParallelConv always
gathers its output; used in such a pair, that allgather is more than the pair needs.

Exercise 8.2 signature: `FilterParallelConv.apply(x, weight, bias, comm, padding) -> y`: x
the whole input (N, Cin, H, W), the same on every rank; weight (Cout_r, Cin, k, k) and bias
(Cout_r,) rows block_range(Cout, rank, size) of the whole convolution's; y the whole output
(N, Cout, H, W) on every rank. Backward returns x's whole gradient (summed over ranks) and
the gradients of this rank's weight and bias rows. MPI collectives are allowed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.nn.grad import conv2d_input, conv2d_weight

from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from ..runtime.reference import reference


def allreduce_sum(comm: Comm, t: torch.Tensor) -> torch.Tensor:
    """A new tensor: t summed over comm's ranks."""
    out = np.empty(t.shape, dtype=torch.empty((), dtype=t.dtype).numpy().dtype)
    comm.Allreduce(t.detach().contiguous().numpy(), out, op=MPI.SUM)
    return torch.from_numpy(out)


def allgather_channels(comm: Comm, y: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Every rank's channels of y (N, C_r, H, W), in rank order (N, sum C_r, H, W); and the C_r."""
    counts = [int(c) for c in _allgather_ints(comm, y.shape[1])]
    per_channel = y.shape[0] * y.shape[2] * y.shape[3]
    whole = torch.empty(sum(counts), y.shape[0], y.shape[2], y.shape[3], dtype=y.dtype)  # channels first
    mine = y.detach().transpose(0, 1).contiguous()
    comm.Allgatherv(mine.numpy(), [whole.numpy(), [c * per_channel for c in counts]])
    return whole.transpose(0, 1), counts


def _allgather_ints(comm: Comm, value: int) -> np.ndarray:
    out = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([value], dtype=np.int64), out)
    return out


class FilterParallelConv(torch.autograd.Function):
    """Forward: my output channels, allgathered. Backward: my weights' gradient; x's gradient summed."""

    @staticmethod
    @reference("filter_parallel_conv")
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm, padding: int
    ) -> torch.Tensor:
        whole, counts = allgather_channels(comm, F.conv2d(x, weight, bias, padding=padding))
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.padding, ctx.has_bias = comm, padding, bias is not None
        ctx.start = sum(counts[: comm.Get_rank()])
        return whole

    @staticmethod
    @reference("filter_parallel_conv")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        mine = grad[:, ctx.start : ctx.start + weight.shape[0]]
        grad_x = None  # the data (a first layer's input) wants no gradient: no allreduce then
        if ctx.needs_input_grad[0]:
            grad_x = allreduce_sum(ctx.comm, conv2d_input(x.shape, weight, mine, padding=ctx.padding))
        grad_weight = conv2d_weight(x, weight.shape, mine, padding=ctx.padding)
        grad_bias = mine.sum(dim=(0, 2, 3)) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None


class ChannelParallelConv(torch.autograd.Function):
    """Forward: my input channels' partial output, summed over ranks, plus bias. Backward: no messages.

    The input's gradient returned is this rank's channels' only (see the module docstring for when that suffices).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm, padding: int
    ) -> torch.Tensor:
        out = allreduce_sum(comm, F.conv2d(x, weight, padding=padding))
        ctx.save_for_backward(x, weight)
        ctx.padding, ctx.has_bias = padding, bias is not None
        return out if bias is None else out + bias.detach().view(1, -1, 1, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        grad_x = conv2d_input(x.shape, weight, grad, padding=ctx.padding) if ctx.needs_input_grad[0] else None
        grad_weight = conv2d_weight(x, weight.shape, grad, padding=ctx.padding)
        grad_bias = grad.sum(dim=(0, 2, 3)) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None


def filter_slice(conv: torch.nn.Conv2d, comm: Comm) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
    """This rank's output channels of conv: copies of its weight rows and bias entries, as parameters."""
    rows = block_range(conv.out_channels, comm.Get_rank(), comm.Get_size())
    bias = None if conv.bias is None else torch.nn.Parameter(conv.bias.detach()[rows.start : rows.stop].clone())
    return torch.nn.Parameter(conv.weight.detach()[rows.start : rows.stop].clone()), bias


def channel_slice(conv: torch.nn.Conv2d, comm: Comm) -> tuple[torch.nn.Parameter, slice]:
    """This rank's input channels of conv: a copy of its weight columns, and which input channels they are."""
    cols = block_range(conv.in_channels, comm.Get_rank(), comm.Get_size())
    return torch.nn.Parameter(conv.weight.detach()[:, cols.start : cols.stop].clone()), slice(cols.start, cols.stop)

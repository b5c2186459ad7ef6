"""The conjugate pairs of tensor parallelism, as autograd functions.

Megatron-LM (Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism", 2019, section 3) needs two functions around a split
MLP or attention block, each the other's conjugate:

- `Copy` ("f"): forward the identity (every rank needs the whole input of a
  column-parallel layer); backward an allreduce (each rank's columns gave a part of the
  input's gradient; the input's gradient is their sum).
- `Reduce` ("g"): forward an allreduce (each rank's rows of a row-parallel layer give a
  part of the output; the output is their sum); backward the identity (every rank needs
  the whole output gradient, and has it).

Sequence parallelism (Korthikanti et al., MLSys 2023, section 4.2.2) keeps the tensors
between the split layers as blocks of the sequence, and replaces them by another pair:

- `Gather` (Korthikanti et al.'s "g", not Megatron's): forward an allgather of the sequence blocks;
  backward a reduce-scatter (the whole gradient is a sum of parts; each rank keeps its block).
- `ReduceScatter` (their "g-bar"): forward a reduce-scatter to sequence blocks; backward an allgather.

Where the layers on one side of the sequence-parallel region are replicated (every rank computes the same
whole tensor, as a GPT's whole embeddings and loss around the blocks `parallelize_gpt` runs sequence
parallel), the whole gradient arrives the same on every rank and nothing is summed:

- `Scatter`: forward this rank's block of the sequence (a slice, no message); backward an allgather;
- `Gather` with `replicated=True`: forward an allgather; backward this rank's block of the gradient.

(Megatron-LM's `scatter_to_sequence_parallel_region` and `gather_from_sequence_parallel_region` with
`tensor_parallel_output_grad=False`.)

Tensors are (batch, sequence, features): the sequence is dim 1, split by `block_range`.

Exercise 14.1 signature: `Copy.apply(x, comm)` and `Reduce.apply(x, comm)`: x any float
tensor (the same shape and dtype on every rank of comm); Copy returns x's values and in
backward the gradient summed over ranks; Reduce returns x summed over ranks and in
backward the gradient unchanged. Each sends exactly one allreduce (here the ring's two
halves) of x's size, Copy in backward, Reduce in forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from ..runtime.reference import reference
from .collectives import allgather, allreduce, reduce_scatter

SEQUENCE = 1  # the sequence dimension of (batch, sequence, features)


class Copy(torch.autograd.Function):
    """f: identity forward, allreduce backward."""

    @staticmethod
    @reference("conjugates")
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    @reference("conjugates")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return allreduce(ctx.comm, grad), None


class Reduce(torch.autograd.Function):
    """g: allreduce forward, identity backward."""

    @staticmethod
    @reference("conjugates")
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return allreduce(comm, x)

    @staticmethod
    @reference("conjugates")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Gather(torch.autograd.Function):
    """Sequence blocks -> the whole sequence (allgather); backward, the gradient summed and scattered back,
    or with `replicated` (the layers after it compute the same on every rank) this rank's block of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, length: int, replicated: bool = False) -> torch.Tensor:
        ctx.comm, ctx.replicated = comm, replicated
        ctx.rows = block_range(length, comm.Get_rank(), comm.Get_size())
        return allgather(comm, x, SEQUENCE, length)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.replicated:
            return grad.narrow(SEQUENCE, ctx.rows.start, len(ctx.rows)).clone(), None, None, None
        return reduce_scatter(ctx.comm, grad, SEQUENCE), None, None, None


class Scatter(torch.autograd.Function):
    """The whole sequence, the same on every rank -> this rank's block (no message); backward, the blocks'
    gradients allgathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm, ctx.length = comm, x.shape[SEQUENCE]
        rows = block_range(ctx.length, comm.Get_rank(), comm.Get_size())
        return x.narrow(SEQUENCE, rows.start, len(rows)).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return allgather(ctx.comm, grad, SEQUENCE, ctx.length), None


class ReduceScatter(torch.autograd.Function):
    """Partial sums of the whole sequence -> this rank's block of their sum; backward, the blocks allgathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm, ctx.length = comm, x.shape[SEQUENCE]
        return reduce_scatter(comm, x, SEQUENCE)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return allgather(ctx.comm, grad, SEQUENCE, ctx.length), None

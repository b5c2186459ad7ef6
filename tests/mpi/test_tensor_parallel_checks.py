"""Lab 14's checks pass the reference and valid alternatives, and fail the wrong answers, on every rank.

Every rank runs the same tests; the checks make all ranks raise the same error.
"""

from __future__ import annotations

import pytest
import torch
from ddlab.checks import CheckFailed, check_conjugates, check_parallel_linear, check_vocab_parallel_cross_entropy
from ddlab.tensor_parallel import (
    Copy,
    Reduce,
    allgather,
    allreduce,
    column_parallel_linear,
    reduce_scatter,
    row_parallel_linear,
    vocab_parallel_cross_entropy,
)
from mpi4py import MPI


class CopyAllreducesForward(torch.autograd.Function):
    """The conjugates swapped: Copy with Reduce's behaviour."""

    @staticmethod
    def forward(ctx, x, comm):
        return allreduce(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceAllreducesBackward(torch.autograd.Function):
    """The conjugates swapped: Reduce with Copy's behaviour."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return allreduce(ctx.comm, grad), None


class CopyByHalves(torch.autograd.Function):
    """Valid, written differently: a copy forward; backward, the ring's two halves called one by one."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        flat = grad.reshape(-1)
        mine = reduce_scatter(ctx.comm, flat, 0)
        return allgather(ctx.comm, mine, 0, flat.numel()).view_as(grad), None


class CopyStub(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        raise NotImplementedError("Exercise 14.1 (Copy) is not done yet: write it where this line is.")


def test_the_reference_conjugates_pass():
    check_conjugates(Copy, Reduce)


def test_a_copy_written_differently_passes():
    check_conjugates(CopyByHalves, Reduce)


@pytest.mark.parametrize(
    "copy, reduce, message",
    [
        (CopyAllreducesForward, Reduce, "Copy: the output differs"),
        (Copy, ReduceAllreducesBackward, "Reduce: the output differs"),
        (CopyAllreducesForward, ReduceAllreducesBackward, "Copy"),
    ],
)
def test_swapped_conjugates_fail(copy, reduce, message):
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("a sum over one rank is the identity: swapped conjugates need 2 ranks to differ")
    with pytest.raises(CheckFailed, match=message):
        check_conjugates(copy, reduce)


def test_the_stub_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="14.1"):
        check_conjugates(CopyStub, Reduce)


def gathers_the_logits(logits, targets, comm, start):
    """Wrong: allgathers every rank's logits, then one process's cross-entropy."""
    vocab = int(allreduce(comm, torch.tensor([float(logits.shape[1])])))
    return torch.nn.functional.cross_entropy(_Whole.apply(logits, allgather(comm, logits, 1, vocab), start), targets)


class _Whole(torch.autograd.Function):
    """The whole logits forward; backward, this rank's columns of the gradient."""

    @staticmethod
    def forward(ctx, mine, whole, start):
        ctx.start, ctx.width = start, mine.shape[1]
        return whole.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.start : ctx.start + ctx.width], None, None


def separate_sums(logits, targets, comm, start):
    """Valid, written differently: the maxima allgathered, then the sums and the target logits in two allreduces."""
    n, width = logits.shape
    largest = allgather(comm, logits.detach().max(dim=1).values.unsqueeze(0), 0, comm.Get_size()).max(dim=0).values
    shifted = logits - largest.unsqueeze(1)
    held = (targets >= start) & (targets < start + width)
    picked = torch.where(
        held,
        shifted.gather(1, (targets - start).clamp(0, width - 1).unsqueeze(1)).squeeze(1),
        torch.zeros(n, dtype=logits.dtype),
    )
    sums = _Summed.apply(shifted.exp().sum(dim=1), comm)
    target = _Summed.apply(picked, comm)
    return (sums.log() - target).mean()


class _Summed(torch.autograd.Function):
    """Allreduce forward; the gradient is the same on every rank (every rank computes the same loss)."""

    @staticmethod
    def forward(ctx, x, comm):
        return allreduce(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def test_the_reference_cross_entropy_passes():
    check_vocab_parallel_cross_entropy(vocab_parallel_cross_entropy)


def test_a_cross_entropy_written_differently_passes():
    check_vocab_parallel_cross_entropy(separate_sums)


def test_a_cross_entropy_that_gathers_the_logits_fails():
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("one rank holds all the logits: gathering them sends nothing")
    with pytest.raises(CheckFailed, match="never gathers the logits"):
        check_vocab_parallel_cross_entropy(gathers_the_logits)


def row_adds_bias_on_every_rank(x, weight, bias, comm):
    """Wrong: the bias added to each rank's part before the sum, so t times in all."""
    return Reduce.apply(torch.nn.functional.linear(x, weight, bias), comm)


def column_by_hand(x, weight, bias, comm):
    """Valid, written differently: the conjugate f around a matmul and an add."""
    return Copy.apply(x, comm) @ weight.T + bias


def test_the_reference_linear_layers_pass():
    check_parallel_linear(column_parallel_linear, row_parallel_linear)


def test_linear_layers_written_differently_pass():
    check_parallel_linear(column_by_hand, row_parallel_linear)


def test_a_row_parallel_layer_adding_its_bias_on_every_rank_fails():
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("on one rank the bias is added once either way")
    with pytest.raises(CheckFailed, match="add the bias, once"):
        check_parallel_linear(column_parallel_linear, row_adds_bias_on_every_rank)

"""Lab 14's checks pass the reference and valid alternatives, and fail the wrong answers, on every rank.

Every rank runs the same tests; the checks make all ranks raise the same error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ddlab.checks import (
    CheckFailed,
    check_conjugates,
    check_parallel_attention,
    check_parallel_linear,
    check_sequence_parallel_block,
    check_vocab_parallel_cross_entropy,
)
from ddlab.models.gpt import causal_attention, dropout_mask, seeded_dropout
from ddlab.runtime.blocks import block_range
from ddlab.tensor_parallel import (
    Copy,
    Gather,
    Reduce,
    ReduceScatter,
    allgather,
    allreduce,
    column_parallel_linear,
    head_range,
    parallel_attention,
    reduce_scatter,
    row_parallel_linear,
    sequence_parallel_block,
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


def heads_split_across_features(x, attn, comm):
    """Wrong: every head kept on every rank, each rank holding a slice of every head's features."""
    config, size, rank = attn.config, comm.Get_size(), comm.Get_rank()
    d = config.n_embd // config.n_head
    mine = block_range(d, rank, size)
    cols = torch.cat([torch.arange(h * d + mine.start, h * d + mine.stop) for h in range(config.n_head)])
    rows = torch.cat([cols, config.n_embd + cols, 2 * config.n_embd + cols])
    q, k, v = column_parallel_linear(x, attn.qkv.weight[rows], attn.qkv.bias[rows], comm).split(len(cols), dim=2)
    y = causal_attention(q, k, v, config.n_head, 0.0, None, 0)
    return row_parallel_linear(y, attn.proj.weight[:, cols], attn.proj.bias, comm)


def every_rank_computes_every_head(x, attn, comm):
    """Wrong: the same messages and values, but no split: every rank computes every head, a t-th of the sum."""
    y = attn(Copy.apply(x, comm), None, 0) - attn.proj.bias
    return Reduce.apply(y / comm.Get_size(), comm) + attn.proj.bias


def attention_by_hand(x, attn, comm):
    """Valid, written differently: q, k and v rows picked one by one, PyTorch's causal attention, f and g by hand."""
    config = attn.config
    heads = head_range(config.n_head, comm)
    d = config.n_embd // config.n_head
    cols = slice(heads.start * d, heads.stop * d)
    whole = Copy.apply(x, comm)
    q, k, v = (
        F.linear(whole, attn.qkv.weight[i * config.n_embd :][cols], attn.qkv.bias[i * config.n_embd :][cols])
        .unflatten(2, (len(heads), d))
        .transpose(1, 2)
        for i in range(3)
    )
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
    return Reduce.apply(y @ attn.proj.weight[:, cols].T, comm) + attn.proj.bias


def attention_stub(x, attn, comm):
    raise NotImplementedError("Exercise 14.3 (attention split by heads) is not done yet: write it where this line is.")


def test_the_reference_attention_passes():
    check_parallel_attention(parallel_attention)


def test_an_attention_written_differently_passes():
    check_parallel_attention(attention_by_hand)


@pytest.mark.parametrize(
    "fn, message",
    [
        (heads_split_across_features, "the output differs"),
        (every_rank_computes_every_head, "qkv's weight gradient differs"),
    ],
)
def test_wrong_attentions_fail(fn, message):
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("on one rank every split is the whole attention")
    with pytest.raises(CheckFailed, match=message):
        check_parallel_attention(fn)


def test_the_attention_stub_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="14.3"):
        check_parallel_attention(attention_stub)


class _SumGrads(torch.autograd.Function):
    """The parameters themselves forward; backward, all their gradients summed over the ranks in one allreduce."""

    @staticmethod
    def forward(ctx, comm, *params):
        ctx.comm, ctx.shapes = comm, [p.shape for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        total = allreduce(ctx.comm, torch.cat([g.reshape(-1) for g in grads]))
        return (None, *total.split([s.numel() for s in ctx.shapes]))


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, length):
        ctx.comm = comm
        return allgather(comm, x, 1, length)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(ctx.comm, grad, 1), None, None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm, ctx.length = comm, x.shape[1]
        return reduce_scatter(comm, x, 1)

    @staticmethod
    def backward(ctx, grad):
        return allgather(ctx.comm, grad, 1, ctx.length), None


def block_by_hand(x, parts, comm, seed, length):
    """Valid, written differently: LayerNorm by hand, masks from dropout_mask, the six whole gradients in one
    allreduce, the two halves as hand-written Functions."""
    rows = block_range(length, comm.Get_rank(), comm.Get_size())
    w1, b1, w2, b2, attn_bias, mlp_bias = _SumGrads.apply(
        comm, parts.ln_1.weight, parts.ln_1.bias, parts.ln_2.weight, parts.ln_2.bias, parts.attn_bias, parts.mlp_bias
    )

    def norm(h, w, b):
        mean, var = h.mean(-1, keepdim=True), h.var(-1, unbiased=False, keepdim=True)
        return _GatherRows.apply((h - mean) / torch.sqrt(var + parts.ln_1.eps) * w + b, comm, length)

    def drop(y, site):
        keep = dropout_mask((x.shape[0], length, x.shape[2]), parts.p, seed, site)[:, rows.start : rows.stop]
        return y * keep / (1 - parts.p)

    x = x + drop(_ScatterRows.apply(parts.attention(norm(x, w1, b1), seed), comm) + attn_bias, parts.site + 1)
    return x + drop(_ScatterRows.apply(parts.mlp(norm(x, w2, b2)), comm) + mlp_bias, parts.site + 2)


def _summed(comm, ln):
    return Copy.apply(ln.weight, comm), Copy.apply(ln.bias, comm)


def _not_summed(comm, ln):
    return ln.weight, ln.bias


def _same_mask_everywhere(y, p, seed, site, whole, part):
    return seeded_dropout(y, p, seed, site)  # the mask of this rank's shape: every rank draws the same


class _GatherKeepingRows(torch.autograd.Function):
    """Wrong: allgather forward; backward, this rank's rows of its own gradient, not summed over the ranks."""

    @staticmethod
    def forward(ctx, x, comm, length):
        ctx.rows = block_range(length, comm.Get_rank(), comm.Get_size())
        return allgather(comm, x, 1, length)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rows.start : ctx.rows.stop].clone(), None, None


class _AllreduceThenRows(torch.autograd.Function):
    """Wrong: an allreduce then this rank's rows, where a reduce-scatter sends half the bytes (backward right)."""

    @staticmethod
    def forward(ctx, y, comm):
        ctx.comm, ctx.length = comm, y.shape[1]
        rows = block_range(y.shape[1], comm.Get_rank(), comm.Get_size())
        return allreduce(comm, y)[:, rows.start : rows.stop].clone()

    @staticmethod
    def backward(ctx, grad):
        return allgather(ctx.comm, grad, 1, ctx.length), None


def _block_with(norm_weights=_summed, drop=seeded_dropout, gather=Gather.apply, scatter=ReduceScatter.apply):
    """The sequence-parallel block with one piece swapped for a wrong one."""

    def block(x, parts, comm, seed, length):
        rows = block_range(length, comm.Get_rank(), comm.Get_size())
        whole, part = (x.shape[0], length, x.shape[2]), (slice(None), slice(rows.start, rows.stop))

        def norm(ln, h):
            return gather(F.layer_norm(h, ln.normalized_shape, *norm_weights(comm, ln), ln.eps), comm, length)

        y = scatter(parts.attention(norm(parts.ln_1, x), seed), comm) + Copy.apply(parts.attn_bias, comm)
        x = x + drop(y, parts.p, seed, parts.site + 1, whole, part)
        y = scatter(parts.mlp(norm(parts.ln_2, x)), comm) + Copy.apply(parts.mlp_bias, comm)
        return x + drop(y, parts.p, seed, parts.site + 2, whole, part)

    return block


def block_stub(x, parts, comm, seed, length):
    raise NotImplementedError("Exercise 14.5 (the sequence-parallel block) is not done yet: write it here.")


def test_the_reference_sequence_parallel_block_passes():
    check_sequence_parallel_block(sequence_parallel_block)


def test_the_block_assembled_from_the_library_pieces_passes():
    check_sequence_parallel_block(_block_with())


def test_a_sequence_parallel_block_written_differently_passes():
    check_sequence_parallel_block(block_by_hand)


@pytest.mark.parametrize(
    "fn, message",
    [
        (_block_with(norm_weights=_not_summed), "ln_1.weight's gradient differs.*sum its gradient"),
        (_block_with(drop=_same_mask_everywhere), "the output differs.*rows of the whole tensor's mask"),
        (_block_with(gather=_GatherKeepingRows.apply), "the input's gradient differs"),
        (_block_with(scatter=_AllreduceThenRows.apply), "an allreduce in place of a reduce-scatter"),
    ],
    ids=[
        "layer-norm-grads-not-summed",
        "same-dropout-mask-on-every-rank",
        "gather-without-reduce-scatter",
        "allreduce-for-reduce-scatter",
    ],
)
def test_wrong_sequence_parallel_blocks_fail(fn, message):
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("on one rank the sequence is not split")
    with pytest.raises(CheckFailed, match=message):
        check_sequence_parallel_block(fn)


def test_the_block_stub_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="14.5"):
        check_sequence_parallel_block(block_stub)


class CopyOnTheGlobalComm(torch.autograd.Function):
    """Wrong: backward sums over the notebook's global communicator, not the one forward was given."""

    @staticmethod
    def forward(ctx, x, comm):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return allreduce(MPI.COMM_WORLD, grad), None


class ReduceOnTheGlobalComm(torch.autograd.Function):
    """Wrong: forward sums over the notebook's global communicator."""

    @staticmethod
    def forward(ctx, x, comm):
        return allreduce(MPI.COMM_WORLD, x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@pytest.mark.parametrize(
    "copy, reduce", [(CopyOnTheGlobalComm, Reduce), (Copy, ReduceOnTheGlobalComm)], ids=["copy", "reduce"]
)
def test_conjugates_on_the_global_communicator_fail_with_a_message(copy, reduce):
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("on one rank the global communicator sends nothing either way")
    with pytest.raises(CheckFailed, match="global communicator"):
        check_conjugates(copy, reduce)

"""Lab 14's checks pass the reference and valid alternatives, and fail the wrong answers, on every rank.

Every rank runs the same tests; the checks make all ranks raise the same error.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from ddlab.checks import (
    CheckFailed,
    check_conjugates,
    check_parallel_linear,
    check_parallelize,
    check_sequence_parallel_block,
    check_vocab_parallel_cross_entropy,
)
from ddlab.models.gpt import dropout_mask, seeded_dropout
from ddlab.runtime.blocks import block_range
from ddlab.runtime.reference import unguarded
from ddlab.tensor_parallel import (
    ColumnParallelLinear,
    Copy,
    Gather,
    GatherLinear,
    Reduce,
    ReduceScatter,
    RowParallelLinear,
    allgather,
    allreduce,
    head_range,
    parallelize,
    qkv_rows,
    reduce_scatter,
    sequence_parallel_block,
    vocab_parallel_cross_entropy,
)
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
block_range = unguarded(block_range)
ColumnParallelLinear = unguarded(ColumnParallelLinear)
Copy = unguarded(Copy)
Reduce = unguarded(Reduce)
RowParallelLinear = unguarded(RowParallelLinear)
parallelize = unguarded(parallelize)
sequence_parallel_block = unguarded(sequence_parallel_block)
vocab_parallel_cross_entropy = unguarded(vocab_parallel_cross_entropy)


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
        (CopyAllreducesForward, Reduce, r"Copy \(float64\): the output differs"),
        (Copy, ReduceAllreducesBackward, r"Reduce \(float64\): the output differs"),
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


class _CrossEntropyWith(torch.autograd.Function):
    """The reference's forward with one thing changed: no maximum subtracted, each rank's own maximum subtracted
    instead of all the ranks', the incoming gradient ignored, the target's -1 in backward placed from rank x width,
    the logits shifted in place, or the target logits gathered into a float64 buffer whatever the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, targets, comm, start, wrong):
        n, width = logits.shape
        largest = allgather(comm, logits.detach().max(dim=1).values.unsqueeze(0), 0, comm.Get_size()).max(0).values
        if wrong == "no-max":
            largest = torch.zeros_like(largest)
        if wrong == "own-max":
            largest = logits.detach().max(dim=1).values
        if wrong == "in-place":
            shifted = logits.detach().sub_(largest.unsqueeze(1))
        else:
            shifted = logits.detach() - largest.unsqueeze(1)
        exp = shifted.exp()
        held = torch.nonzero((targets >= start) & (targets < start + width)).squeeze(1)
        target = torch.zeros(n, dtype=torch.float64 if wrong == "float64-buffer" else logits.dtype)
        target[held] = shifted[held, targets[held] - start]
        sums = allreduce(comm, torch.stack([exp.sum(dim=1), target]))
        if wrong == "backward-from-rank-x-width":  # the -1 placed as if this rank started at rank x its width
            start = comm.Get_rank() * width
            held = torch.nonzero((targets >= start) & (targets < start + width)).squeeze(1)
        ctx.save_for_backward(exp / sums[0].unsqueeze(1), held, targets[held] - start)
        ctx.wrong = wrong
        return (sums[0].log() - sums[1]).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, held, columns = ctx.saved_tensors
        out = softmax.clone()
        out[held, columns] -= 1
        scale = 1.0 if ctx.wrong == "ignores-grad" else grad
        return out * (scale / softmax.shape[0]), None, None, None, None


def _cross_entropy_with(wrong):
    return lambda logits, targets, comm, start: _CrossEntropyWith.apply(logits, targets, comm, start, wrong)


@pytest.mark.parametrize(
    "wrong, message",
    [
        ("no-max", "the loss differs.*not finite: subtract the largest logit"),
        ("own-max", "the loss differs.*m the largest logit of all the ranks"),
        ("ignores-grad", "gradient of this rank's logits differs.*incoming gradient"),
        ("backward-from-rank-x-width", "gradient of this rank's logits differs.*is the target found with `start`"),
        ("in-place", "were changed"),
    ],
)
def test_wrong_cross_entropies_fail(wrong, message):
    if MPI.COMM_WORLD.Get_size() < 2 and wrong in ("own-max", "backward-from-rank-x-width"):
        pytest.skip("on one rank the own maximum is all the ranks', and start is 0")
    with pytest.raises(CheckFailed, match=message):
        check_vocab_parallel_cross_entropy(_cross_entropy_with(wrong))


def shifts_the_targets_in_place(logits, targets, comm, start):
    """Wrong: makes the targets this rank's columns in place, changing the caller's tensor (not on rank 0,
    whose start is 0: the ranks disagree, and the check must still fail on all of them, not hang)."""
    targets -= start
    return vocab_parallel_cross_entropy(logits, targets + start, comm, start)


def test_a_cross_entropy_that_shifts_the_targets_in_place_fails_without_hanging():
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("one rank's start is 0: nothing shifts")
    with pytest.raises(CheckFailed, match="the logits or targets passed in were changed"):
        check_vocab_parallel_cross_entropy(shifts_the_targets_in_place)


def start_from_the_rank(logits, targets, comm, start):
    """Wrong: takes this rank's first column as rank x its width, as if every rank held V/t columns."""
    return vocab_parallel_cross_entropy(logits, targets, comm, comm.Get_rank() * logits.shape[1])


def start_from_zero(logits, targets, comm, start):
    """Wrong: ignores start, as if every rank's columns were the vocabulary's first."""
    return vocab_parallel_cross_entropy(logits, targets, comm, 0)


@pytest.mark.parametrize("fn", [start_from_the_rank, start_from_zero], ids=["rank-times-width", "zero"])
def test_a_cross_entropy_that_ignores_start_fails_naming_start(fn):
    """It subtracts the largest logit: the message must not say it does not, but where the target is looked for."""
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("one rank's start is 0 whatever it computes")
    with pytest.raises(
        CheckFailed, match=r"the loss differs.*is the target found with `start`, not rank x V/t\?"
    ) as err:
        check_vocab_parallel_cross_entropy(fn)
    assert "subtract the largest logit" not in str(err.value)


def cross_entropy_stub(logits, targets, comm, start):
    raise NotImplementedError("Exercise 14.4 (the vocabulary-parallel loss) is not done yet: write it here.")


def test_the_cross_entropy_stub_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="14.4"):
        check_vocab_parallel_cross_entropy(cross_entropy_stub)


def test_a_cross_entropy_that_gathers_the_logits_fails():
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("one rank holds all the logits: gathering them sends nothing")
    with pytest.raises(CheckFailed, match="never gathers the logits"):
        check_vocab_parallel_cross_entropy(gathers_the_logits)


class RowAddsBiasOnEveryRank(RowParallelLinear):
    """Wrong: the bias added to each rank's part before the sum, so t times in all."""

    def forward(self, x):
        return Reduce.apply(F.linear(x, self.weight, self.bias), self.comm)


class ColumnKeepsTheWholeWeight(torch.nn.Module):
    """Wrong: keeps the whole weight and slices it on every call (the same values and gradients of its rows)."""

    def __init__(self, linear, features, comm):
        super().__init__()
        self.whole, self.features, self.comm = torch.nn.Linear(1, 1), features, comm
        self.whole.weight = torch.nn.Parameter(linear.weight.detach().clone())
        self.whole.bias = torch.nn.Parameter(linear.bias.detach().clone())
        self.weight, self.bias = self.whole.weight, self.whole.bias

    def forward(self, x):
        return F.linear(Copy.apply(x, self.comm), self.weight[self.features], self.bias[self.features])


class ColumnByHand(torch.nn.Module):
    """Valid, written differently: index_select for the shard, f around a matmul and an add."""

    def __init__(self, linear, features, comm):
        super().__init__()
        self.comm = comm
        self.weight = torch.nn.Parameter(linear.weight.detach().index_select(0, features).clone())
        self.bias = torch.nn.Parameter(linear.bias.detach().index_select(0, features).clone())

    def forward(self, x):
        return Copy.apply(x, self.comm) @ self.weight.T + self.bias


class ColumnIgnoresTheIncomingGradient(torch.autograd.Function):
    """Wrong: f's backward allreduces ones instead of the incoming gradient (a plain sum's)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return allreduce(ctx.comm, torch.ones_like(grad)), None


class ColumnWithABadCopy(ColumnParallelLinear):
    def forward(self, x):
        return F.linear(ColumnIgnoresTheIncomingGradient.apply(x, self.comm), self.weight, self.bias)


def test_the_reference_linear_layers_pass():
    check_parallel_linear(ColumnParallelLinear, RowParallelLinear)


def test_linear_layers_written_differently_pass():
    check_parallel_linear(ColumnByHand, RowParallelLinear)


@pytest.mark.parametrize(
    "column, row, message",
    [
        (ColumnParallelLinear, RowAddsBiasOnEveryRank, "add the bias, once"),
        (ColumnKeepsTheWholeWeight, RowParallelLinear, "keep only this rank's shard|column's weight"),
        (ColumnWithABadCopy, RowParallelLinear, "the input's gradient differs"),
    ],
    ids=["row-bias-on-every-rank", "column-keeps-the-whole-weight", "backward-ignores-the-gradient"],
)
def test_wrong_linear_layers_fail(column, row, message):
    if MPI.COMM_WORLD.Get_size() < 2 and column is not ColumnKeepsTheWholeWeight:
        pytest.skip("on one rank the bias is added once and the sum is the identity")
    with pytest.raises(CheckFailed, match=message):
        check_parallel_linear(column, row)


def linear_stub(linear, features, comm):
    raise NotImplementedError("Exercise 14.2 (the column-parallel layer) is not done yet: write it here.")


def test_the_linear_stub_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="14.2"):
        check_parallel_linear(linear_stub, RowParallelLinear)


def _parallelize_with(features=None, copy_block=True, check=True, set_heads=True, world=False, layer_dtype=None):
    """A module surgery like the library's with one piece swapped: features(name, config, comm) -> index;
    world: the layers built on the notebook's global communicator instead of the one passed in; layer_dtype: the
    split layers converted to that dtype whatever the block's."""

    def fn(block, given, plan):
        comm = MPI.COMM_WORLD if world else given
        if check:
            from ddlab.tensor_parallel.surgery import check_plan

            check_plan(plan)
        split = copy.deepcopy(block) if copy_block else block
        config = block.config
        heads = head_range(config.n_head, comm)
        for name, kind in plan.items():
            owner, _, child = name.rpartition(".")
            parent = split.get_submodule(owner)
            index = (features or _megatron_features)(name, config, comm)
            layer = ColumnParallelLinear if kind == "column" else RowParallelLinear
            built = layer(getattr(parent, child), index, comm)
            setattr(parent, child, built if layer_dtype is None else built.to(layer_dtype))
        if set_heads == "always" or (set_heads and "attn.qkv" in plan):  # "always": wrong when attention stays whole
            split.attn.heads = heads
        return split

    return fn


def _megatron_features(name, config, comm):
    heads = head_range(config.n_head, comm)
    d = config.n_embd // config.n_head
    if name == "attn.qkv":
        return qkv_rows(config.n_embd, config.n_head, heads)
    if name == "attn.proj":
        return torch.arange(heads.start * d, heads.stop * d)
    hidden = block_range(4 * config.n_embd, comm.Get_rank(), comm.Get_size())
    return torch.arange(hidden.start, hidden.stop)


def _features_across_heads(name, config, comm):
    """Wrong: a slice of every head's features on each rank, instead of whole heads."""
    if not name.startswith("attn"):
        return _megatron_features(name, config, comm)
    d = config.n_embd // config.n_head
    mine = block_range(d, comm.Get_rank(), comm.Get_size())
    cols = torch.cat([torch.arange(h * d + mine.start, h * d + mine.stop) for h in range(config.n_head)])
    return torch.cat([cols, config.n_embd + cols, 2 * config.n_embd + cols]) if name == "attn.qkv" else cols


def _qkv_as_one_block(name, config, comm):
    """Wrong: qkv's rows taken as one contiguous block of its 3 n_embd rows, not the heads' rows of q, k and v."""
    if name != "attn.qkv":
        return _megatron_features(name, config, comm)
    rows = block_range(3 * config.n_embd, comm.Get_rank(), comm.Get_size())
    return torch.arange(rows.start, rows.stop)


def keeps_the_whole_block_too(block, comm, plan):
    """Wrong: the split block is right, but keeps the whole one inside it as well."""
    split = parallelize(block, comm, plan)
    split.whole = copy.deepcopy(block)
    return split


def checks_attention_pairs_only(block, comm, plan):
    """Wrong: refuses unknown layers and a wrong attention pair, but lets the MLP's layers through as they come."""
    if set(plan) - {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}:
        raise ValueError("not a layer of a block")
    if (plan.get("attn.qkv"), plan.get("attn.proj")) not in ((None, None), ("column", "row")):
        raise ValueError("attention splits column then row")
    return _parallelize_with(check=False)(block, comm, plan)


def refuses_lone_layers_only(block, comm, plan):
    """Wrong: refuses unknown layers and a layer without its pair, but not the MLP's pair the wrong way round."""
    if set(plan) - {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}:
        raise ValueError("not a layer of a block")
    for first, second in (("attn.qkv", "attn.proj"), ("mlp.fc", "mlp.proj")):
        if (first in plan) != (second in plan):
            raise ValueError("a layer without its pair")
    if plan.get("attn.qkv", "column") != "column":
        raise ValueError("attention splits column then row")
    return _parallelize_with(check=False)(block, comm, plan)


def tells_the_block_given_its_heads(block, comm, plan):
    """Wrong: the split block is right, but the block passed in is told this rank's heads too."""
    split = parallelize(block, comm, plan)
    block.attn.heads = split.attn.heads
    return split


def splits_all_four_layers(block, comm, plan):
    """Wrong: checks the plan, then splits attention and MLP whatever it names."""
    from ddlab.tensor_parallel.surgery import PLAN, check_plan

    check_plan(plan)
    return parallelize(block, comm, PLAN)


def parallelize_stub(block, comm, plan):
    raise NotImplementedError("Exercise 14.3 (parallelize) is not done yet: write it where this line is.")


def test_the_reference_parallelize_passes():
    check_parallelize(parallelize)


def test_a_parallelize_written_differently_passes():
    check_parallelize(_parallelize_with())


@pytest.mark.parametrize(
    "fn, message",
    [
        (_parallelize_with(features=_features_across_heads), "the output differs|raised an error"),
        (_parallelize_with(features=_qkv_as_one_block), "the output differs|raised an error"),
        (_parallelize_with(copy_block=False), "the block passed in was changed"),
        (_parallelize_with(check=False), "should raise ValueError"),
        (
            _parallelize_with(set_heads=False),
            r"(?s)attention was split but attn.heads still names all 4 heads: set it to head_range\(n_head, comm\)",
        ),
        (keeps_the_whole_block_too, "keep only the shards"),
        (_parallelize_with(world=True), "global communicator"),
        (checks_attention_pairs_only, r"\(the MLP's first layer alone\) should raise ValueError"),
        (refuses_lone_layers_only, r"\(the MLP the wrong way round\) should raise ValueError"),
        (tells_the_block_given_its_heads, "the block passed in was changed.*attn.heads"),
        (
            splits_all_four_layers,
            r"(?s)the plan \{'attn.qkv': 'column', 'attn.proj': 'row'\} .*leaves this layer whole",
        ),
        (
            _parallelize_with(set_heads="always"),
            r"(?s)the plan \{'mlp.fc': 'column', 'mlp.proj': 'row'\}.*the attention stays whole here but attn.heads "
            r"was set to range\(.*set attn.heads only when the attention is split",
        ),
    ],
    ids=[
        "heads-split-across-features",
        "qkv-as-one-block",
        "changes-the-block-passed-in",
        "accepts-a-bad-plan",
        "attention-not-told-its-heads",
        "keeps-the-whole-block-too",
        "layers-on-the-global-communicator",
        "refuses-wrong-attention-pairs-only",
        "accepts-the-mlp-the-wrong-way-round",
        "changes-the-heads-of-the-block-passed-in",
        "splits-all-four-layers-whatever-the-plan",
        "tells-a-whole-attention-its-heads",
    ],
)
def test_wrong_parallelizes_fail(fn, message):
    if MPI.COMM_WORLD.Get_size() < 2 and message == "global communicator":
        pytest.skip("on one rank the global communicator sends nothing either way")
    if MPI.COMM_WORLD.Get_size() < 2 and (
        message.startswith("the output differs") or fn is tells_the_block_given_its_heads or "(?s)" in message
    ):
        pytest.skip("on one rank every split is the whole block")
    with pytest.raises(CheckFailed, match=message):
        check_parallelize(fn)


def test_the_parallelize_stub_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="14.3"):
        check_parallelize(parallelize_stub)


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


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm, ctx.length = comm, x.shape[1]
        return reduce_scatter(comm, x, 1)

    @staticmethod
    def backward(ctx, grad):
        return allgather(ctx.comm, grad, 1, ctx.length), None


class _GatherLinearByHand(torch.autograd.Function):
    """Valid, written differently: keeps only its block, regathers in backward, einsum for the weight's gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, length):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.length = comm, length
        return allgather(comm, x, 1, length) @ weight.T + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = allgather(ctx.comm, x, 1, ctx.length)
        grad_x = reduce_scatter(ctx.comm, grad @ weight, 1)
        return grad_x, torch.einsum("bto,bti->oi", grad, whole), grad.sum(dim=(0, 1)), None, None


def block_by_hand(x, parts, comm, seed, length):
    """Valid, written differently: masks from dropout_mask, the six whole gradients in one allreduce, the
    gathering linear and the reduce-scatter as hand-written Functions."""
    rows = block_range(length, comm.Get_rank(), comm.Get_size())
    w1, b1, w2, b2, attn_bias, mlp_bias = _SumGrads.apply(
        comm, parts.ln_1.weight, parts.ln_1.bias, parts.ln_2.weight, parts.ln_2.bias, parts.attn_bias, parts.mlp_bias
    )

    def drop(y, site):
        keep = dropout_mask((x.shape[0], length, x.shape[2]), parts.p, seed, site)[:, rows.start : rows.stop]
        return y.masked_fill(~keep, 0) / (1 - parts.p)

    h = F.layer_norm(x, (x.shape[2],), w1, b1, parts.ln_1.eps)
    qkv = _GatherLinearByHand.apply(h, parts.qkv.weight, parts.qkv.bias, comm, length)
    y = _ScatterRows.apply(parts.heads(qkv, seed) @ parts.attn_proj_weight.T, comm)
    x = x + drop(y + attn_bias, parts.site + 1)
    h = F.layer_norm(x, (x.shape[2],), w2, b2, parts.ln_2.eps)
    hidden = F.gelu(_GatherLinearByHand.apply(h, parts.fc.weight, parts.fc.bias, comm, length))
    return x + drop(_ScatterRows.apply(hidden @ parts.mlp_proj_weight.T, comm) + mlp_bias, parts.site + 2)


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


def _gather_linear(x, weight, bias, comm, length):
    return GatherLinear.apply(x, weight, bias, comm, length)


def _gather_then_linear(gather):
    """A gather (Function) and then an ordinary linear layer, which keeps the whole gathered input."""
    return lambda x, weight, bias, comm, length: F.linear(gather(x, comm, length), weight, bias)


def _block_with(
    norm_weights=_summed,
    drop=seeded_dropout,
    linear=_gather_linear,
    scatter=ReduceScatter.apply,
    norm_after_gather=False,
):
    """The sequence-parallel block with one piece swapped for a wrong one."""

    def block(x, parts, comm, seed, length):
        rows = block_range(length, comm.Get_rank(), comm.Get_size())
        whole, part = (x.shape[0], length, x.shape[2]), (slice(None), slice(rows.start, rows.stop))

        def column(ln, h, layer):
            weight, bias = norm_weights(comm, ln)
            if norm_after_gather:  # wrong: normalizes the whole gathered sequence, so keeps its input whole
                h = F.layer_norm(Gather.apply(h, comm, length), ln.normalized_shape, weight, bias, ln.eps)
                return F.linear(h, layer.weight, layer.bias)
            return linear(
                F.layer_norm(h, ln.normalized_shape, weight, bias, ln.eps), layer.weight, layer.bias, comm, length
            )

        y = scatter(F.linear(parts.heads(column(parts.ln_1, x, parts.qkv), seed), parts.attn_proj_weight), comm)
        x = x + drop(y + Copy.apply(parts.attn_bias, comm), parts.p, seed, parts.site + 1, whole, part)
        y = scatter(F.linear(F.gelu(column(parts.ln_2, x, parts.fc)), parts.mlp_proj_weight), comm)
        return x + drop(y + Copy.apply(parts.mlp_bias, comm), parts.p, seed, parts.site + 2, whole, part)

    return block


def block_stub(x, parts, comm, seed, length):
    raise NotImplementedError("Exercise 14.5 (the sequence-parallel block) is not done yet: write it here.")


def test_the_reference_sequence_parallel_block_passes():
    check_sequence_parallel_block(sequence_parallel_block)


def test_the_block_assembled_from_the_library_pieces_passes():  # GatherLinear, ReduceScatter, Copy
    check_sequence_parallel_block(_block_with())


def test_a_sequence_parallel_block_written_differently_passes():
    check_sequence_parallel_block(block_by_hand)


@pytest.mark.parametrize(
    "fn, message",
    [
        (_block_with(norm_weights=_not_summed), "ln_1.weight's gradient differs.*sum its gradient"),
        (_block_with(drop=_same_mask_everywhere), "the output differs.*rows of the whole tensor's mask"),
        (_block_with(linear=_gather_then_linear(_GatherKeepingRows.apply)), "the input's gradient differs"),
        (_block_with(scatter=_AllreduceThenRows.apply), "an allreduce in place of a reduce-scatter"),
        (_block_with(linear=_gather_then_linear(Gather.apply)), "times Korthikanti et al.'s count"),
        (_block_with(norm_after_gather=True), "times Korthikanti et al.'s count"),
    ],
    ids=[
        "layer-norm-grads-not-summed",
        "same-dropout-mask-on-every-rank",
        "gather-without-reduce-scatter",
        "allreduce-for-reduce-scatter",
        "linear-keeps-the-gathered-input",
        "layer-norm-after-the-allgather",
    ],
)
def test_wrong_sequence_parallel_blocks_fail(fn, message):
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("on one rank the sequence is not split")
    with pytest.raises(CheckFailed, match=message):
        check_sequence_parallel_block(fn)


class CopyByClone(torch.autograd.Function):
    """f returning a copy of x (14.1's check accepts it): F.layer_norm then saves a copy of its weight and bias."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return allreduce(ctx.comm, grad), None


def _summed_copies(comm, ln):
    return CopyByClone.apply(ln.weight, comm), CopyByClone.apply(ln.bias, comm)


def test_f_returning_a_copy_passes_both_checks():
    check_conjugates(CopyByClone, Reduce)
    check_sequence_parallel_block(_block_with(norm_weights=_summed_copies))


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


# Every check runs float64 and float32 (the lab trains in one and times in the other): an answer that makes a result
# or a buffer in a fixed dtype passes the float64 case and fails the float32 one, saying so.


class ReduceInFloat64(torch.autograd.Function):
    """Wrong: sums a float64 copy of x, whatever x's dtype (right in float64)."""

    @staticmethod
    def forward(ctx, x, comm):
        return allreduce(comm, x.to(torch.float64))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class CopyBackwardInFloat64(torch.autograd.Function):
    """Wrong: backward sums a float64 copy of the gradient (autograd casts it back; twice the bytes go)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return allreduce(ctx.comm, grad.to(torch.float64)), None


@pytest.mark.parametrize(
    "copy, reduce, message",
    [
        (Copy, ReduceInFloat64, r"Reduce \(float32\): the output has .*dtype torch.float64, expected .*torch.float32"),
        (CopyBackwardInFloat64, Reduce, r"Copy \(float32\) sent 0 bytes forward and \d+ backward"),
    ],
    ids=["reduce-returns-float64", "copy-sums-in-float64"],
)
def test_conjugates_in_a_fixed_dtype_fail_in_float32(copy, reduce, message):
    if MPI.COMM_WORLD.Get_size() < 2 and copy is CopyBackwardInFloat64:
        pytest.skip("on one rank the allreduce sends nothing: its dtype does not show in the bytes")
    with pytest.raises(CheckFailed, match=message):
        check_conjugates(copy, reduce)


class ColumnFloat64Shard(ColumnParallelLinear):
    """Wrong: its shard made in float64 whatever the layer's dtype (right in float64)."""

    def __init__(self, linear, features, comm):
        super().__init__(linear, features, comm)
        self.weight = torch.nn.Parameter(self.weight.detach().to(torch.float64))
        self.bias = torch.nn.Parameter(self.bias.detach().to(torch.float64))


def test_linear_layers_in_a_fixed_dtype_fail_in_float32():
    with pytest.raises(CheckFailed, match=r"(?s)float32.*(dtype|Double|Float)"):
        check_parallel_linear(ColumnFloat64Shard, RowParallelLinear)


def parallelize_in_float64(block, comm, plan):
    """Wrong: the surgery builds its split layers in float64 whatever the block's dtype (right in float64)."""
    return _parallelize_with(layer_dtype=torch.float64)(block, comm, plan)


def test_a_parallelize_in_a_fixed_dtype_fails_in_float32():
    with pytest.raises(CheckFailed, match=r"(?s)parallelize \(float32\).*(dtype|Double|Float)"):
        check_parallelize(parallelize_in_float64)


def test_a_cross_entropy_with_a_float64_buffer_fails_in_float32():
    with pytest.raises(CheckFailed, match=r"(?s)float32.*(dtype torch.float64, expected torch.float32|Double|Float)"):
        check_vocab_parallel_cross_entropy(_cross_entropy_with("float64-buffer"))


class _GatherIntoFloat64(torch.autograd.Function):
    """Wrong: gathers the sequence into a float64 buffer whatever x's dtype (right in float64)."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, length):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.length, ctx.has_bias = comm, length, True
        whole = torch.zeros(x.shape[0], length, x.shape[2], dtype=torch.float64)
        whole.copy_(allgather(comm, x, 1, length))
        return F.linear(whole, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        return GatherLinear.backward(ctx, grad)


def test_a_sequence_parallel_block_with_a_float64_buffer_fails_in_float32():
    fn = _block_with(linear=lambda x, w, b, comm, length: _GatherIntoFloat64.apply(x, w, b, comm, length))
    with pytest.raises(CheckFailed, match=r"(?s)sequence-parallel block \(float32\).*(dtype|Double|Float)"):
        check_sequence_parallel_block(fn)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("conjugates", "ddlab.tensor_parallel.Copy", (Reduce,)),
        ("parallel_linear", "ddlab.tensor_parallel.ColumnParallelLinear", (RowParallelLinear,)),
        ("vocab_parallel_cross_entropy", "ddlab.tensor_parallel.vocab_parallel_cross_entropy", ()),
        ("parallelize", "ddlab.tensor_parallel.parallelize", ()),
        ("sequence_parallel_block", "ddlab.tensor_parallel.sequence_parallel_block", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)

"""Lab 14's checks graded on cases the notebook never shows (ddlab.checks._draw).

With DDLAB_GRADE_SEED set, each check of lab 14 draws its ranks, sizes and seeds within what the lab
states. The library's answers pass under every seed and without one; each answer below is fitted to
the notebook's cases (a shape, a vocabulary, a head count, a sequence length, a dropout seed, the
interleaved features): it passes the notebook's check and fails the grader's draw, naming the drawn case.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ddlab.checks import (
    CheckFailed,
    check_conjugates,
    check_parallel_linear,
    check_parallelize,
    check_sequence_parallel_block,
    check_vocab_parallel_cross_entropy,
)
from ddlab.checks._draw import Draw
from ddlab.checks.tensor_parallel import (
    BLOCK_LENGTH,
    HEADS,
    SEED,
    SHAPE,
    VOCAB,
    _drawn_block,
    _drawn_mlp,
    _drawn_tensors,
    _drawn_vocab,
)
from ddlab.runtime.blocks import block_range
from ddlab.runtime.reference import unguarded
from ddlab.tensor_parallel import (
    ColumnParallelLinear,
    Copy,
    Reduce,
    RowParallelLinear,
    allreduce,
    parallelize,
    qkv_rows,
    sequence_parallel_block,
    vocab_parallel_cross_entropy,
)
from ddlab.tensor_parallel.surgery import check_plan
from mpi4py import MPI

WORLD = MPI.COMM_WORLD.Get_size()
#: The checks graded on the lab's 4 engines only, as its wrong-answer tests (test_mpi_suites.py): about 50 s a run.
ON_THE_LAB_S_RANKS = pytest.mark.skipif(
    WORLD != 4, reason="lab 14's checks are graded on the lab's 4 ranks; on others the suite runs the library's tests"
)

Copy = unguarded(Copy)
Reduce = unguarded(Reduce)
ColumnParallelLinear = unguarded(ColumnParallelLinear)
RowParallelLinear = unguarded(RowParallelLinear)
parallelize = unguarded(parallelize)
sequence_parallel_block = unguarded(sequence_parallel_block)
vocab_parallel_cross_entropy = unguarded(vocab_parallel_cross_entropy)


# Answers fitted to the notebook's cases ------------------------------------------------


class CopyIntoTheNotebooksShape(torch.autograd.Function):
    """14.1's Copy whose backward sums into a buffer of the notebook's x, (3, 5, 4)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(3, 5, 4, dtype=grad.dtype)
        out.copy_(allreduce(ctx.comm, grad))
        return out, None


def cross_entropy_of_97(logits, targets, comm, start):
    """14.4's loss finding the target from the blocks of the notebook's vocabulary of 97, not from `start`."""
    return vocab_parallel_cross_entropy(logits, targets, comm, block_range(97, comm.Get_rank(), comm.Get_size()).start)


class ColumnInterleaved(ColumnParallelLinear):
    """14.2's column layer ignoring `features`: the notebook's interleaved ones, rank r of t holding r, r + t, ..."""

    def __init__(self, linear, features, comm):
        super().__init__(linear, torch.arange(comm.Get_rank(), linear.out_features, comm.Get_size()), comm)


class RowInterleaved(RowParallelLinear):
    """14.2's row layer ignoring `features` the same way."""

    def __init__(self, linear, features, comm):
        super().__init__(linear, torch.arange(comm.Get_rank(), linear.in_features, comm.Get_size()), comm)


def parallelize_of_4_heads(block, comm, plan):
    """14.3's surgery with the notebook's 4 heads written in, not block.config.n_head."""
    check_plan(plan)
    h, rank, size = block.config.n_embd, comm.Get_rank(), comm.Get_size()
    heads, hidden = block_range(4, rank, size), block_range(4 * h, rank, size)
    d = h // 4
    features = {
        "attn.qkv": qkv_rows(h, 4, heads),
        "attn.proj": torch.arange(heads.start * d, heads.stop * d),
        "mlp.fc": torch.arange(hidden.start, hidden.stop),
        "mlp.proj": torch.arange(hidden.start, hidden.stop),
    }
    split = copy.deepcopy(block)
    for name, kind in plan.items():
        owner, _, child = name.rpartition(".")
        parent = split.get_submodule(owner)
        layer = ColumnParallelLinear if kind == "column" else RowParallelLinear
        setattr(parent, child, layer(getattr(parent, child), features[name], comm))
    if "attn.qkv" in plan:
        split.attn.heads = heads
    return split


def block_of_10(x, parts, comm, seed, length):
    """14.5's block with the notebook's sequence of 10 written in, not `length`."""
    return sequence_parallel_block(x, parts, comm, seed, 10)


def block_of_seed_9(x, parts, comm, seed, length):
    """14.5's block dropping with the notebook's seed 9, not the `seed` it is given."""
    return sequence_parallel_block(x, parts, comm, 9, length)


FITTED = [  # (check, its arguments with the fitted answer, what the seed must draw, words the failure names)
    (
        check_conjugates,
        (CopyIntoTheNotebooksShape, Reduce),
        lambda draw: _drawn_tensors(draw).shape != SHAPE,
        ["Copy", "x of shape", "data seed"],
    ),
    (
        check_vocab_parallel_cross_entropy,
        (cross_entropy_of_97,),
        lambda draw: _drawn_vocab(draw).vocab != VOCAB,
        ["positions, a vocabulary of", "data seed"],
    ),
    (
        check_parallel_linear,
        (ColumnInterleaved, RowInterleaved),
        lambda draw: _drawn_mlp(draw, WORLD).hidden > WORLD,  # a shuffle of more than t features deals others
        ["hidden features dealt by a shuffle of seed", "weights and data of seed"],
    ),
    (
        check_parallelize,
        (parallelize_of_4_heads,),
        lambda draw: _drawn_block(draw, WORLD).heads != HEADS,
        ["a block of", "heads and n_embd", "dropout seed"],
    ),
    (
        check_sequence_parallel_block,
        (block_of_10,),
        lambda draw: _drawn_block(draw, WORLD).length != BLOCK_LENGTH,
        ["a block of", "x of shape", "dropout seed"],
    ),
    (
        check_sequence_parallel_block,
        (block_of_seed_9,),
        lambda draw: _drawn_block(draw, WORLD).seed != SEED,
        ["a block of", "dropout seed"],
    ),
]


@ON_THE_LAB_S_RANKS
@pytest.mark.parametrize("check, answer, needs, words", FITTED, ids=lambda v: getattr(v, "__name__", ""))
def test_an_answer_fitted_to_the_notebook_passes_its_check_and_fails_the_grader_s_draw(
    comm, seed, seed_with, check, answer, needs, words
):
    check(*answer)  # the notebook's own cases: it passes
    value = seed_with(needs, check.__name__.removeprefix("check_"), among=range(1000))
    seed(value)
    with pytest.raises(CheckFailed) as failed:
        check(*answer)
    message = str(failed.value)
    for word in [*words, f"the grader's draw, seed {value}"]:
        assert word in message, message


RIGHT = [
    (check_conjugates, (Copy, Reduce)),
    (check_parallel_linear, (ColumnParallelLinear, RowParallelLinear)),
    (check_parallelize, (parallelize,)),
    (check_vocab_parallel_cross_entropy, (vocab_parallel_cross_entropy,)),
    (check_sequence_parallel_block, (sequence_parallel_block,)),
]


@ON_THE_LAB_S_RANKS
@pytest.mark.parametrize("check, answer", RIGHT, ids=lambda v: getattr(v, "__name__", ""))
def test_the_library_s_answer_passes_without_a_seed_and_under_every_seed(comm, passes_on_every_seed, check, answer):
    passes_on_every_seed(lambda: check(*answer), comm=comm)


def test_the_draws_stay_in_the_lab_s_domain_and_without_a_seed_are_the_notebook_s():
    assert (_drawn_tensors(None).shape, _drawn_vocab(None).vocab, _drawn_block(None, WORLD).heads) == (
        SHAPE,
        VOCAB,
        HEADS,
    )
    assert _drawn_mlp(None, WORLD).features(1, 3).tolist() == list(range(1, 12, 3)), "the notebook's interleaving"
    for value in range(100):
        tensors = _drawn_tensors(Draw(value, "conjugates"))
        assert 1 <= len(tensors.shape) <= 3 and all(1 <= n <= 6 for n in tensors.shape)
        vocab = _drawn_vocab(Draw(value, "vocab_parallel_cross_entropy"))
        assert 8 <= vocab.n <= 40 and all(vocab.vocab % t for t in range(2, WORLD + 1)), "no rank count but 1 divides V"
        assert vocab.vocab // WORLD >= 10, "every rank holds well over the 4 values per position it may send"
        mlp = _drawn_mlp(Draw(value, "parallel_linear"), WORLD)
        for size in range(1, WORLD + 1):
            dealt = [mlp.features(rank, size) for rank in range(size)]
            assert all(len(f) for f in dealt) and sorted(torch.cat(dealt).tolist()) == list(range(mlp.hidden))
        block = _drawn_block(Draw(value, "sequence_parallel_block"), WORLD)
        assert WORLD <= block.heads <= 6 and block.embd // block.heads in (2, 3, 4) and block.embd % block.heads == 0
        assert WORLD <= block.length <= 12 and 1 <= block.batch <= 3, "every rank holds heads and rows"

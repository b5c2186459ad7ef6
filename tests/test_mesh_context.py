"""Lab 16's context dimension on one process: the zig-zag rows, ring attention as a block's attention, bad input.

A ring of one rank holds every position in order (zig-zag chunks 0 and 1 of 2), so a block whose heads
attend by lab 15's ring attention must compute one process's block, forward and backward; the multi-rank
equality is tests/mpi/test_mesh.py's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from ddlab.context_parallel import ring_attention_heads, zigzag_positions
from ddlab.mesh import context_rows
from ddlab.models.gpt import Block, GPTConfig
from ddlab.tensor_parallel import ParallelBlock
from mpi4py import MPI

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=4, n_embd=16, tied=False)


@dataclass
class _Place:
    """A rank's place in a context group, as far as context_rows asks (its size and rank)."""

    size: int
    rank: int

    def Get_size(self) -> int:  # noqa: N802 (MPI's name)
        return self.size

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank


def test_context_rows_are_the_zigzag_positions_and_cover_the_sequence():
    assert torch.equal(context_rows(8, _Place(1, 0)), torch.arange(8))
    rows = [context_rows(12, _Place(3, r)) for r in range(3)]
    assert [r.tolist() for r in rows] == [zigzag_positions(12, 3, r).tolist() for r in range(3)]
    assert rows[0].tolist() == [0, 1, 10, 11]
    assert sorted(torch.cat(rows).tolist()) == list(range(12))


@pytest.mark.parametrize(("length", "size"), [(8, 3), (6, 4), (7, 2)])
def test_a_sequence_that_does_not_split_into_2c_chunks_says_what_to_do(length, size):
    with pytest.raises(ValueError, match=f"does not split into 2 x {size} .* multiple of {2 * size}"):
        context_rows(length, _Place(size, 0))


def test_a_block_attending_by_the_ring_of_one_rank_is_one_process_block():
    torch.manual_seed(0)
    block = Block(CONFIG, 0).double()
    ring = ParallelBlock(block, MPI.COMM_SELF, attend=functools.partial(ring_attention_heads, MPI.COMM_SELF))
    x = torch.randn(2, 8, CONFIG.n_embd, dtype=torch.float64, requires_grad=True)
    mine = x.detach().clone().requires_grad_()
    want, got = block(x), ring(mine)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    want.square().sum().backward()
    got.square().sum().backward()
    assert torch.allclose(mine.grad, x.grad, atol=1e-12, rtol=0)
    ours = dict(ring.named_parameters())
    qkv = ours["attn.qkv.weight"].grad
    assert qkv is not None and torch.allclose(qkv, block.attn.qkv.weight.grad, atol=1e-12, rtol=0)


def test_ring_attention_heads_refuses_rows_that_are_not_two_chunks():
    q = torch.zeros(1, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="use an even n"):
        ring_attention_heads(MPI.COMM_SELF, q, q, q, 2)


def test_another_attention_with_dropout_is_refused():
    block = Block(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=4, n_embd=16, dropout=0.1), 0)
    with pytest.raises(ValueError, match="dropout=0.0"):
        ParallelBlock(block, MPI.COMM_SELF, attend=functools.partial(ring_attention_heads, MPI.COMM_SELF))

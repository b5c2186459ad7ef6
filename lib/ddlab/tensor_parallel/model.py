"""A whole GPT split over a tensor group, built from a one-process GPT's weights; and data x tensor training.

`TensorParallelGPT(model, comm)` copies this rank's part of every weight of `model` (a
`ddlab.models.gpt.GPT`): the vocabulary rows of the embedding (and of the output layer),
each block's heads and MLP features; the position embedding and the LayerNorms stay whole
(replicated) on every rank. Its forward returns this rank's logits (B, T, V/t) and the
loss, which is the same on every rank and equal to one process's; its gradients are this
rank's parts of one process's.

With `sequence_parallel=True` the residual stream between blocks is this rank's block of
the sequence (the sequence length must be at least t). The whole parameters that act on
a block of the sequence (position embedding, LayerNorms, row-parallel biases) get the
gradient of their block's tokens only: `reduce_sequence_parallel_grads` sums them over
the tensor group after backward.

Data x tensor (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC 2021): P = D x T ranks form D tensor groups of T
consecutive ranks (`make_data_tensor_grid`); the ranks holding the same part in different
groups form a data group, train on different samples, and average their gradients (lab
04's `average_gradients`) before the optimizer's step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from ..data_parallel import average_gradients
from ..intra_layer import make_grid
from ..models.gpt import GPT, Block, seeded_dropout
from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from .block import ParallelBlock, Samples, residual_part
from .collectives import allreduce
from .conjugates import Copy, Gather
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


class TensorParallelGPT(nn.Module):
    """This rank's part of a GPT over comm's ranks (Megatron-style tensor parallel, optionally sequence parallel)."""

    def __init__(self, model: GPT, comm: Comm, sequence_parallel: bool = False):
        super().__init__()
        self.config, self.comm, self.sequence_parallel = model.config, comm, sequence_parallel
        self.wte = VocabParallelEmbedding(model.wte, comm, sequence_parallel)
        self.vocab = self.wte.vocab
        self.wpe = copy.deepcopy(model.wpe)
        self.blocks = nn.ModuleList(
            ParallelBlock(cast(Block, block), comm, sequence_parallel) for block in model.blocks
        )
        self.ln_f = copy.deepcopy(model.ln_f)
        self.lm_head = (
            None
            if model.lm_head is None
            else nn.Parameter(model.lm_head.weight.detach()[self.vocab.start : self.vocab.stop].clone())
        )

    @property
    def output_weight(self) -> torch.Tensor:
        """This rank's rows of the output layer (the embedding's when tied)."""
        return self.wte.weight if self.lm_head is None else self.lm_head

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        seed: int | None = None,
        samples: Samples | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) whole on every rank -> this rank's logits (B, T, V_r) and the mean loss (if targets).
        samples: which samples of a global batch idx is (data parallelism), so dropout drops what one process does."""
        batch, length = idx.shape
        if length > self.config.block_size:
            raise ValueError(f"a sequence of {length} tokens is longer than block_size={self.config.block_size}")
        if self.training and self.config.dropout > 0 and seed is None:
            raise ValueError("training with dropout needs seed= (e.g. the step number): the masks are drawn from it")
        seed = seed if self.training else None
        size = self.comm.Get_size()
        positions = torch.arange(length)
        shape: tuple[int, ...] = (batch, length, self.config.n_embd)
        if self.sequence_parallel:
            if length < size:
                raise ValueError(f"a sequence of {length} tokens cannot be split over {size} ranks")
            rows = block_range(length, self.comm.Get_rank(), size)
            positions = positions[rows.start : rows.stop]
            shape = (batch, len(rows), self.config.n_embd)
        whole, part = residual_part(shape, length, self.comm, self.sequence_parallel, samples)
        x = seeded_dropout(self.wte(idx) + self.wpe(positions), self.config.dropout, seed, 0, whole, part)
        for block in self.blocks:
            x = block(x, seed, length, samples)
        x = self.ln_f(x)
        x = Gather.apply(x, self.comm, length) if self.sequence_parallel else Copy.apply(x, self.comm)
        logits = F.linear(x, self.output_weight)
        if targets is None:
            return logits, None
        return logits, vocab_parallel_cross_entropy(
            logits.flatten(0, 1), targets.flatten(), self.comm, self.vocab.start
        )

    def replicated_parameters(self) -> list[torch.Tensor]:
        """The parameters every rank of the tensor group holds whole: position embedding, LayerNorms,
        row-parallel biases. The others are split."""
        whole = [self.wpe.weight, *self.ln_f.parameters()]
        for block in self.blocks:
            whole += cast(ParallelBlock, block).replicated_parameters()
        return whole

    def sequence_parallel_parameters(self) -> list[torch.Tensor]:
        """The whole parameters that act on sequence blocks: the replicated ones, with sequence parallelism."""
        return self.replicated_parameters() if self.sequence_parallel else []


def reduce_sequence_parallel_grads(model: TensorParallelGPT) -> None:
    """Sum over the tensor group the gradients of the whole parameters that saw one sequence block each."""
    params = [p for p in model.sequence_parallel_parameters() if p.grad is not None]
    if not params or model.comm.Get_size() == 1:
        return
    total = allreduce(model.comm, torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]))
    offset = 0
    with torch.no_grad():
        for p in params:
            assert p.grad is not None
            p.grad.copy_(total[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


@dataclass
class DataTensorGrid:
    """This rank's two sub-communicators: `tensor` (its group's T ranks), `data` (the same part in every group)."""

    tensor: MPI.Comm
    data: MPI.Comm

    def free(self) -> None:
        self.tensor.Free()
        self.data.Free()


def make_data_tensor_grid(comm: MPI.Comm, tensor_ways: int) -> DataTensorGrid:
    """Split comm's P ranks into P / tensor_ways tensor groups of consecutive ranks (lab 08's grid). Collective."""
    size = comm.Get_size()
    if tensor_ways < 1 or size % tensor_ways:
        raise ValueError(f"{size} ranks do not form groups of {tensor_ways}: tensor_ways must divide the rank count")
    grid = make_grid(comm, size // tensor_ways)
    return DataTensorGrid(tensor=grid.spatial, data=grid.data)


def train_step(
    model: TensorParallelGPT,
    optimizer: torch.optim.Optimizer,
    idx: torch.Tensor,
    targets: torch.Tensor,
    data: MPI.Comm | None = None,
    seed: int | None = None,
) -> float:
    """One step on the global batch (idx, targets), whole on every rank; returns its mean loss.

    With `data` (a data group of D ranks), this rank's tensor group takes its block of the
    batch's samples (D must divide the batch) and the gradients are averaged over `data`.
    Dropout draws the whole batch's masks from `seed` and keeps this rank's samples (`Samples`),
    so the run steps as one process does on the whole batch, with dropout or without.
    """
    ways = 1 if data is None else data.Get_size()
    if idx.shape[0] % ways:
        raise ValueError(f"a batch of {idx.shape[0]} does not split evenly over {ways} data ranks: use a multiple")
    mine = block_range(idx.shape[0], 0 if data is None else data.Get_rank(), ways)
    samples = Samples(mine, idx.shape[0])
    _, loss = model(idx[mine.start : mine.stop], targets[mine.start : mine.stop], seed=seed, samples=samples)
    assert loss is not None
    optimizer.zero_grad()
    loss.backward()
    reduce_sequence_parallel_grads(model)
    value = float(loss.detach())
    if data is not None and ways > 1:
        average_gradients(model, data)
        value = data.allreduce(value) / ways
    optimizer.step()
    return value

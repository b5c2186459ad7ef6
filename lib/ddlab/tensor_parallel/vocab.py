"""The vocabulary split over a tensor group: the embedding, the output layer and the loss.

Rank r holds the rows `block_range(vocab_size, r, t)` of the token embedding (Shoeybi et
al., 2019, section 3; with tied embeddings the same rows are the output layer's).

- Embedding: a token this rank holds is looked up, any other gives zeros; the sum over
  ranks (`Reduce`, or with sequence parallelism `ReduceScatter`) is the whole embedding.
- Output layer: column-parallel over the vocabulary: each rank computes the logits of its
  tokens, (B, T, V/t). The logits are never gathered: that allgather would send b x s x v
  values; Shoeybi et al. fuse the loss with the output layer so that only a few b x s scalars
  are communicated (each rank's largest logits, then the sums and the target's logits).
- Cross-entropy on split logits, per position n: loss = log sum_v exp(z_v - m) - (z_target - m),
  with m the largest logit. Each rank finds its largest logit; the ranks' largest are
  allgathered (t numbers per position) and m is their maximum; then each rank's sum of
  exp(z - m) over its tokens and its part of z_target - m (zero unless it holds the target)
  are summed over ranks in one allreduce of 2 numbers per position. Backward needs no
  message: the gradient of rank r's logits is G/N (softmax(z)_v - [v = target]) for its v, with G the
  gradient arriving at the mean loss over N positions.

Exercise 14.4 signature: `vocab_parallel_cross_entropy(logits, targets, comm, start)`:
logits (N, V_r) this rank's columns, the vocabulary entries start .. start + V_r - 1
(block_range); targets (N,) int64 whole on every rank; returns the mean over N of the
cross-entropy as a 0-dim tensor, the same on every rank, with the gradient of this
rank's logits through autograd, and without gathering the logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from ..runtime.reference import reference
from .collectives import allgather, allreduce
from .conjugates import Reduce, ReduceScatter


def vocab_range(vocab_size: int, comm: Comm) -> range:
    """The vocabulary entries this rank holds."""
    if vocab_size < comm.Get_size():
        raise ValueError(f"a vocabulary of {vocab_size} cannot be split over {comm.Get_size()} ranks")
    return block_range(vocab_size, comm.Get_rank(), comm.Get_size())


class VocabParallelEmbedding(nn.Module):
    """Rows `vocab_range` of a whole embedding: (B, T) token ids -> the whole (B, T, n_embd), or a sequence block."""

    def __init__(self, embedding: nn.Embedding, comm: Comm, sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.vocab = vocab_range(embedding.num_embeddings, comm)
        self.weight = nn.Parameter(embedding.weight.detach()[self.vocab.start : self.vocab.stop].clone())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab.start) | (idx >= self.vocab.stop)
        local = (idx - self.vocab.start).masked_fill(outside, 0)
        part = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return ReduceScatter.apply(part, self.comm) if self.sequence_parallel else Reduce.apply(part, self.comm)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split by vocabulary: one allgather of maxima, one allreduce of sums."""

    @staticmethod
    @reference("vocab_parallel_cross_entropy")
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, comm: Comm, start: int) -> torch.Tensor:
        n, mine = logits.shape
        local_max = logits.detach().max(dim=1).values
        largest = allgather(comm, local_max.unsqueeze(0), 0, comm.Get_size()).max(dim=0).values
        exp = (logits.detach() - largest.unsqueeze(1)).exp()
        held = (targets >= start) & (targets < start + mine)
        rows = torch.nonzero(held).squeeze(1)
        target = torch.zeros_like(largest)
        target[rows] = logits.detach()[rows, targets[rows] - start] - largest[rows]
        sums = allreduce(comm, torch.stack([exp.sum(dim=1), target]))
        ctx.save_for_backward(exp / sums[0].unsqueeze(1), rows, targets[rows] - start)
        return (sums[0].log() - sums[1]).mean()

    @staticmethod
    @reference("vocab_parallel_cross_entropy")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        softmax, rows, columns = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits[rows, columns] -= 1
        return grad_logits * (grad / softmax.shape[0]), None, None, None


@reference("vocab_parallel_cross_entropy")
def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm: Comm, start: int) -> torch.Tensor:
    """Mean cross-entropy over N positions of logits (N, V_r) holding vocabulary entries start .. start + V_r - 1."""
    return VocabParallelCrossEntropy.apply(logits, targets, comm, start)

"""The transformer block split over a tensor group: attention by heads, the MLP by its hidden features.

Rank r of t holds heads `block_range(n_head, r, t)`: its rows of the q, k and v projections
(column-parallel: a head needs all of the input, none of the other heads) and the matching
columns of the output projection (row-parallel). Rank r also holds hidden features
`block_range(4 n_embd, r, t)` of the MLP: rows of its first layer, columns of its second.
GELU acts feature by feature, so it runs on the split features with no message. Per block,
forward: one allreduce after attention, one after the MLP; backward: one in each `Copy`
(Shoeybi et al., 2019, figure 3). The LayerNorms are whole on every rank.

With sequence parallelism (Korthikanti et al., MLSys 2023, figure 5) the residual stream,
the LayerNorms and the dropouts work on this rank's block of the sequence; each allreduce
becomes an allgather before the column-parallel layer and a reduce-scatter after the
row-parallel one. The LayerNorm weights and the row-parallel biases then see only this
block's tokens: their gradients are summed over the tensor group after backward
(`ddlab.tensor_parallel.model.reduce_sequence_parallel_grads`).

Dropout draws the mask of the whole tensor and keeps this rank's part (its heads, its block
of the sequence), so the split block drops exactly what one process's does.

Exercise 14.3 signature: `ParallelAttention(attn, comm)(x, seed=None, site=1)` with `attn`
a `ddlab.models.gpt.CausalSelfAttention`: x the whole input (B, T, n_embd) on every rank;
returns the whole output; this rank's parameters are its heads' rows of `qkv` and columns of
`proj` (and proj's whole bias).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..models.gpt import MLP, Block, CausalSelfAttention, causal_attention, seeded_dropout
from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from .layers import ColumnParallelLinear, RowParallelLinear


def head_range(n_head: int, comm: Comm) -> range:
    """The heads this rank holds."""
    if n_head < comm.Get_size():
        raise ValueError(f"{n_head} heads cannot be split over {comm.Get_size()} ranks: use at most n_head ranks")
    return block_range(n_head, comm.Get_rank(), comm.Get_size())


def qkv_rows(n_embd: int, n_head: int, heads: range) -> torch.Tensor:
    """The rows of the (3 n_embd, n_embd) q, k, v weight that belong to `heads`: theirs of q, of k, of v."""
    d = n_embd // n_head
    mine = torch.arange(heads.start * d, heads.stop * d)
    return torch.cat([mine, n_embd + mine, 2 * n_embd + mine])


class ParallelAttention(nn.Module):
    """This rank's heads of a CausalSelfAttention."""

    def __init__(self, attn: CausalSelfAttention, comm: Comm, sequence_parallel: bool = False):
        super().__init__()
        config = attn.config
        self.config, self.heads = config, head_range(config.n_head, comm)
        d = config.n_embd // config.n_head
        self.qkv = ColumnParallelLinear(
            attn.qkv, qkv_rows(config.n_embd, config.n_head, self.heads), comm, sequence_parallel
        )
        self.proj = RowParallelLinear(
            attn.proj, torch.arange(self.heads.start * d, self.heads.stop * d), comm, sequence_parallel
        )

    def forward(
        self, x: torch.Tensor, seed: int | None = None, site: int = 1, length: int | None = None
    ) -> torch.Tensor:
        width = len(self.heads) * (self.config.n_embd // self.config.n_head)
        q, k, v = self.qkv(x, length).split(width, dim=2)
        y = causal_attention(
            q,
            k,
            v,
            len(self.heads),
            self.config.dropout,
            seed,
            site,
            self.config.n_head,
            slice(self.heads.start, self.heads.stop),
        )
        return self.proj(y)


class ParallelMLP(nn.Module):
    """This rank's hidden features of an MLP: rows of fc (column-parallel), columns of proj (row-parallel)."""

    def __init__(self, mlp: MLP, comm: Comm, sequence_parallel: bool = False):
        super().__init__()
        hidden = block_range(mlp.fc.out_features, comm.Get_rank(), comm.Get_size())
        features = torch.arange(hidden.start, hidden.stop)
        self.fc = ColumnParallelLinear(mlp.fc, features, comm, sequence_parallel)
        self.proj = RowParallelLinear(mlp.proj, features, comm, sequence_parallel)

    def forward(self, x: torch.Tensor, length: int | None = None) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x, length)))


class ParallelBlock(nn.Module):
    """A Block split over comm's ranks (tensor parallel, and sequence parallel if asked)."""

    def __init__(self, block: Block, comm: Comm, sequence_parallel: bool = False):
        super().__init__()
        self.config, self.site, self.comm, self.sequence_parallel = block.config, block.site, comm, sequence_parallel
        self.ln_1, self.ln_2 = copy.deepcopy(block.ln_1), copy.deepcopy(block.ln_2)
        self.attn = ParallelAttention(block.attn, comm, sequence_parallel)
        self.mlp = ParallelMLP(block.mlp, comm, sequence_parallel)

    def forward(self, x: torch.Tensor, seed: int | None = None, length: int | None = None) -> torch.Tensor:
        """x: the whole (B, T, n_embd), or with sequence parallelism this rank's block of a sequence `length` long."""
        whole: tuple[int, ...] | None = None
        part: tuple[slice, ...] = ()
        if self.sequence_parallel:
            if length is None:
                raise ValueError("a sequence-parallel block needs the whole sequence's length")
            rows = block_range(length, self.comm.Get_rank(), self.comm.Get_size())
            whole, part = (x.shape[0], length, x.shape[2]), (slice(None), slice(rows.start, rows.stop))
        p = self.config.dropout
        x = x + seeded_dropout(self.attn(self.ln_1(x), seed, self.site, length), p, seed, self.site + 1, whole, part)
        return x + seeded_dropout(self.mlp(self.ln_2(x), length), p, seed, self.site + 2, whole, part)

    def replicated_parameters(self) -> list[torch.Tensor]:
        """The parameters every rank holds whole: LayerNorms, row-parallel biases (with sequence parallelism
        they act on sequence blocks, and their gradients must be summed over the tensor group)."""
        params: list[torch.Tensor] = [*self.ln_1.parameters(), *self.ln_2.parameters()]
        return params + [b for b in (self.attn.proj.bias, self.mlp.proj.bias) if b is not None]

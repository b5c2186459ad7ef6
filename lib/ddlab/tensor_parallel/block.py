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

`parallel_attention(x, attn, comm)` is the functional form of the heads' split (whole weights indexed,
attn a whole `ddlab.models.gpt.CausalSelfAttention`, dropout off); exercise 14.3 writes the module form,
`ddlab.tensor_parallel.surgery.parallelize`.

Exercise 14.5 signature: `sequence_parallel_block(x, parts, comm, seed, length)`: x this rank's
rows `block_range(length, rank, t)` of the residual stream (B, T_r, n_embd); parts a `BlockParts`;
returns this rank's rows of the block's output, equal to one process's `Block(x, seed)`, with the
whole LayerNorms' and biases' gradients summed over the ranks (each saw only its rows); its
column-parallel layers are `GatherLinear`s, which keep only this rank's block of their input, so what
it keeps for backward is Korthikanti et al.'s sbh(34/t + 5as/(ht)).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..models.gpt import MLP, Block, CausalSelfAttention, GPTConfig, causal_attention, seeded_dropout
from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from ..runtime.reference import reference
from .conjugates import Copy, ReduceScatter
from .layers import ColumnParallelLinear, GatherLinear, RowParallelLinear, column_parallel_linear, row_parallel_linear

#: Another attention for a rank's heads: q, k, v (B, T, heads x d) and the number of heads -> (B, T, heads x d)
#: (lab 16 passes lab 15's ring attention over the context ranks; None: `causal_attention` on this rank).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class Samples:
    """This rank's samples `rows` of a global batch of `total` (data parallelism): dropout draws the
    whole batch's masks and keeps these rows, so a data-parallel run drops what one process does."""

    rows: range
    total: int

    @property
    def part(self) -> slice:
        return slice(self.rows.start, self.rows.stop)


def residual_part(
    shape: tuple[int, ...], length: int | None, comm: Comm, sequence_parallel: bool, samples: Samples | None = None
) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """The whole residual-stream tensor's shape and this rank's part of it (its samples; with sequence
    parallelism its rows `block_range(length, rank, t)`), for `seeded_dropout`; shape is this rank's."""
    batch, mine = (shape[0], slice(None)) if samples is None else (samples.total, samples.part)
    if not sequence_parallel:
        return (batch, *shape[1:]), (mine,)
    if length is None:
        raise ValueError("a sequence-parallel layer needs the whole sequence's length")
    rows = block_range(length, comm.Get_rank(), comm.Get_size())
    return (batch, length, *shape[2:]), (mine, slice(rows.start, rows.stop))


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
    """This rank's heads of a CausalSelfAttention; `attend`, if given, computes their attention (no dropout)."""

    def __init__(
        self, attn: CausalSelfAttention, comm: Comm, sequence_parallel: bool = False, attend: Attend | None = None
    ):
        super().__init__()
        config = attn.config
        if attend is not None and config.dropout > 0:
            raise ValueError("another attention (attend) runs without dropout: build the GPT with dropout=0.0")
        self.config, self.heads, self.attend = config, head_range(config.n_head, comm), attend
        d = config.n_embd // config.n_head
        self.qkv = ColumnParallelLinear(
            attn.qkv, qkv_rows(config.n_embd, config.n_head, self.heads), comm, sequence_parallel
        )
        self.proj = RowParallelLinear(
            attn.proj, torch.arange(self.heads.start * d, self.heads.stop * d), comm, sequence_parallel
        )

    def forward(
        self,
        x: torch.Tensor,
        seed: int | None = None,
        site: int = 1,
        length: int | None = None,
        samples: Samples | None = None,
    ) -> torch.Tensor:
        return self.proj(self._heads(self.qkv(x, length), seed, site, samples))

    def _heads(self, qkv: torch.Tensor, seed: int | None, site: int, samples: Samples | None = None) -> torch.Tensor:
        """This rank's q, k, v (B, T, 3 x its heads' width) -> its heads' attention output (B, T, their width)."""
        if self.attend is not None:
            q, k, v = qkv.split(len(self.heads) * (self.config.n_embd // self.config.n_head), dim=2)
            return self.attend(q, k, v, len(self.heads))
        return heads_attention(qkv, self.config, self.heads, seed, site, samples)


def heads_attention(
    qkv: torch.Tensor, config: GPTConfig, heads: range, seed: int | None, site: int, samples: Samples | None = None
) -> torch.Tensor:
    """q, k, v of `heads` (B, T, 3 x their width) -> their causal attention (B, T, their width), no message; the
    probabilities drop with these heads' (and samples') part of the whole mask at `site`."""
    q, k, v = qkv.split(len(heads) * (config.n_embd // config.n_head), dim=2)
    return causal_attention(
        q,
        k,
        v,
        len(heads),
        config.dropout,
        seed,
        site,
        config.n_head,
        slice(heads.start, heads.stop),
        None if samples is None else samples.total,
        slice(None) if samples is None else samples.part,
    )


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
    """A Block split over comm's ranks (tensor parallel, and sequence parallel if asked); attend: see ParallelAttention."""

    def __init__(self, block: Block, comm: Comm, sequence_parallel: bool = False, attend: Attend | None = None):
        super().__init__()
        self.config, self.site, self.comm, self.sequence_parallel = block.config, block.site, comm, sequence_parallel
        self.ln_1, self.ln_2 = copy.deepcopy(block.ln_1), copy.deepcopy(block.ln_2)
        self.attn = ParallelAttention(block.attn, comm, sequence_parallel, attend)
        self.mlp = ParallelMLP(block.mlp, comm, sequence_parallel)

    def forward(
        self, x: torch.Tensor, seed: int | None = None, length: int | None = None, samples: Samples | None = None
    ) -> torch.Tensor:
        """x: the whole (B, T, n_embd), or with sequence parallelism this rank's block of a sequence `length` long;
        samples: which samples of a global batch x holds (data parallelism), for the dropout masks."""
        whole, part = residual_part(tuple(x.shape), length, self.comm, self.sequence_parallel, samples)
        p = self.config.dropout
        y = self.attn(self.ln_1(x), seed, self.site, length, samples)
        x = x + seeded_dropout(y, p, seed, self.site + 1, whole, part)
        return x + seeded_dropout(self.mlp(self.ln_2(x), length), p, seed, self.site + 2, whole, part)

    def replicated_parameters(self) -> list[torch.Tensor]:
        """The parameters every rank holds whole: LayerNorms, row-parallel biases (with sequence parallelism
        they act on sequence blocks, and their gradients must be summed over the tensor group)."""
        params: list[torch.Tensor] = [*self.ln_1.parameters(), *self.ln_2.parameters()]
        return params + [b for b in (self.attn.proj.bias, self.mlp.proj.bias) if b is not None]


class BlockParts(nn.Module):
    """This rank's parts of a Block, for writing its sequence-parallel forward (exercise 14.5) by hand.

    `BlockParts(block, comm)` splits a whole Block over comm (the library's `ParallelBlock`);
    `BlockParts(split)`, without comm, takes the parts of a block already split over its tensor group: by
    `ddlab.tensor_parallel.parallelize`, or exercise 14.3's `my_parallelize` (`parallelize_gpt` with a
    sequence-parallel block does this). Either way `split` is that split block, and:

    `ln_1`, `ln_2`, `attn_bias`, `mlp_bias`: the whole LayerNorms and row-parallel biases (the same on
    every rank); `qkv` and `fc`: this rank's column-parallel layers (`.weight`, `.bias`: its rows);
    `attn_proj_weight`, `mlp_proj_weight`: its columns of the row-parallel layers; `heads(qkv, seed)`:
    its q, k, v -> its heads' attention output (dropout on the probabilities, its part of the mask), no
    message; `p`: the dropout probability; `site`: the block's first dropout site (the two residual
    dropouts are at site + 1 and site + 2).
    """

    split: Any  # ParallelBlock, or the block a parallelize made (the student's layers)
    ln_1: nn.LayerNorm
    ln_2: nn.LayerNorm
    attn_bias: torch.Tensor | None
    mlp_bias: torch.Tensor | None
    qkv: Any  # a column-parallel layer: .weight, .bias
    fc: Any
    attn_proj_weight: torch.Tensor
    mlp_proj_weight: torch.Tensor

    def __init__(self, block: nn.Module, comm: Comm | None = None):
        super().__init__()
        self.split = block if comm is None else ParallelBlock(cast(Block, block), comm)
        split = self.split
        self.ln_1, self.ln_2 = split.ln_1, split.ln_2
        self.attn_bias, self.mlp_bias = split.attn.proj.bias, split.mlp.proj.bias
        self.qkv, self.fc = split.attn.qkv, split.mlp.fc
        self.attn_proj_weight, self.mlp_proj_weight = split.attn.proj.weight, split.mlp.proj.weight
        self.config: GPTConfig = split.config
        self.p, self.site, self.held = self.config.dropout, int(split.site), cast(range, split.attn.heads)

    def heads(self, qkv: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        """This rank's q, k, v (B, T, 3 x its heads' width) -> its heads' attention (B, T, their width); no message."""
        return heads_attention(qkv, self.config, self.held, seed, self.site)


def parallel_attention(x: torch.Tensor, attn: CausalSelfAttention, comm: Comm) -> torch.Tensor:
    """The whole output of `attn` (dropout off) from this rank's heads only: their rows of qkv, columns of proj."""
    config = attn.config
    heads = head_range(config.n_head, comm)
    d = config.n_embd // config.n_head
    rows, cols = qkv_rows(config.n_embd, config.n_head, heads), torch.arange(heads.start * d, heads.stop * d)
    bias = None if attn.qkv.bias is None else attn.qkv.bias[rows]
    q, k, v = column_parallel_linear(x, attn.qkv.weight[rows], bias, comm).split(len(cols), dim=2)
    y = causal_attention(q, k, v, len(heads), 0.0, None, 0)
    return row_parallel_linear(y, attn.proj.weight[:, cols], attn.proj.bias, comm)


def _summed_grad(p: torch.Tensor | None, comm: Comm) -> torch.Tensor | None:
    """p itself forward; backward its gradient summed over comm (a whole parameter that saw one sequence block)."""
    return None if p is None else Copy.apply(p, comm)


@reference("sequence_parallel_block")
def sequence_parallel_block(
    x: torch.Tensor, parts: BlockParts, comm: Comm, seed: int | None, length: int
) -> torch.Tensor:
    """This rank's rows of a Block's output from its rows x of the input (Korthikanti et al., figure 5): the
    column-parallel layers gather the sequence and keep only this rank's block of their input (GatherLinear)."""
    whole, part = residual_part(tuple(x.shape), length, comm, sequence_parallel=True)

    def norm(ln: nn.LayerNorm, h: torch.Tensor) -> torch.Tensor:
        weight, bias = _summed_grad(ln.weight, comm), _summed_grad(ln.bias, comm)
        return F.layer_norm(h, ln.normalized_shape, weight, bias, ln.eps)

    def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        summed = _summed_grad(bias, comm)
        return y if summed is None else y + summed

    qkv = GatherLinear.apply(norm(parts.ln_1, x), parts.qkv.weight, parts.qkv.bias, comm, length)
    y = ReduceScatter.apply(F.linear(parts.heads(qkv, seed), parts.attn_proj_weight), comm)
    x = x + seeded_dropout(add_bias(y, parts.attn_bias), parts.p, seed, parts.site + 1, whole, part)
    hidden = F.gelu(GatherLinear.apply(norm(parts.ln_2, x), parts.fc.weight, parts.fc.bias, comm, length))
    y = ReduceScatter.apply(F.linear(hidden, parts.mlp_proj_weight), comm)
    return x + seeded_dropout(add_bias(y, parts.mlp_bias), parts.p, seed, parts.site + 2, whole, part)

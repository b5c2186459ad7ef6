"""Module surgery: one process's transformer block made tensor parallel by replacing its layers (exercise 14.3).

`parallelize(block, comm, plan)` is the idea of PyTorch's `parallelize_module`: a plan names each
linear layer of a `ddlab.models.gpt.Block` "column" or "row", and the layer is replaced by a
`ColumnParallelLinear` or `RowParallelLinear` that keeps only this rank's shard of its weight:

- attention splits by heads: rank r computes heads `head_range(n_head, comm)`, so `attn.qkv`
  (column) keeps those heads' rows of q, k and v (`qkv_rows`) and `attn.proj` (row) the matching
  columns; the attention module is told its heads (`attn.heads`) so that it splits q, k and v
  at their width and drops its part of the whole dropout mask;
- the MLP splits by hidden features: `mlp.fc` (column) keeps rows `block_range(4 n_embd, r, t)`,
  `mlp.proj` (row) the same columns.

A column layer must feed the row layer of the same sub-layer (its output features are the row
layer's input features), so a plan names both layers of a sub-layer, the first "column" and the
second "row", or neither. The block returned is a new one; LayerNorms stay whole (replicated).
With the blocks of a GPT replaced this way (`parallelize_gpt`), the embeddings, the last
LayerNorm and the loss stay whole on every rank and the model steps as one process does.

`parallelize_gpt(..., vocab_loss=loss)` splits the vocabulary too (`VocabParallelGPT`): the token embedding's
rows `vocab_range` (the tied output layer's too) and the loss by `loss` on this rank's logits, which are never
gathered (exercise 14.4's `vocab_parallel_cross_entropy`, or the student's).

`parallelize_gpt(..., sequence_parallel=block_forward)` runs the split blocks sequence parallel
(Korthikanti et al., MLSys 2023, section 4.2.2) with a block forward such as exercise 14.5's
(`sequence_parallel_block(x, parts, comm, seed, length)`, its parts taken from each split block by
`BlockParts(split)`): the residual stream between the blocks holds this rank's rows of the sequence.
The embeddings, the last LayerNorm and the loss stay whole and the same on every rank, so the whole
embedding output is cut to this rank's rows before the first block (`Scatter`: no message; backward
an allgather of the rows' gradients) and the last block's rows are allgathered after it (`Gather`
with `replicated=True`: backward keeps this rank's rows of the whole gradient, which every rank has).

Exercise 14.3 signature: `parallelize(block, comm, plan)` -> a new Block, the one passed in
left as it was; a plan naming a layer the block lacks, or any kind but "column" and "row", or
one layer of a pair without the other, raises ValueError.
"""

from __future__ import annotations

import copy
from typing import Callable, Mapping, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..models.gpt import GPT, Block, seeded_dropout
from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from ..runtime.reference import reference
from .block import BlockParts, head_range, qkv_rows
from .conjugates import Copy, Gather, Scatter
from .layers import ColumnParallelLinear, RowParallelLinear
from .vocab import VocabParallelEmbedding

#: Builds one rank's block from a whole one: `parallelize`, or the student's.
Parallelize = Callable[[Block, Comm, Mapping[str, str]], nn.Module]

#: A block's sequence-parallel forward (exercise 14.5): (this rank's rows x, parts, comm, seed, the sequence's
#: length) -> this rank's rows of the block's output; `sequence_parallel_block`, or the student's.
SequenceBlock = Callable[[torch.Tensor, BlockParts, Comm, int | None, int], torch.Tensor]

#: A vocabulary-parallel loss (exercise 14.4): (this rank's logits (N, V_r), targets (N,), comm, start) -> the mean.
VocabLoss = Callable[[torch.Tensor, torch.Tensor, Comm, int], torch.Tensor]

#: Megatron-LM's plan for a GPT block (Shoeybi et al., 2019, figure 3).
PLAN: dict[str, str] = {"attn.qkv": "column", "attn.proj": "row", "mlp.fc": "column", "mlp.proj": "row"}

#: The sub-layers' pairs: (the layer that must be column-parallel, the one that must be row-parallel).
PAIRS = (("attn.qkv", "attn.proj"), ("mlp.fc", "mlp.proj"))


def check_plan(plan: Mapping[str, str]) -> None:
    """ValueError unless plan names whole pairs of PAIRS, each "column" then "row"."""
    known = {name for pair in PAIRS for name in pair}
    unknown = sorted(set(plan) - known)
    if unknown:
        raise ValueError(f"the plan names {unknown}, not layers of a Block: use {sorted(known)}")
    for first, second in PAIRS:
        given = (plan.get(first), plan.get(second))
        if given not in ((None, None), ("column", "row")):
            raise ValueError(
                f"the plan gives {first}: {given[0]!r}, {second}: {given[1]!r}; a sub-layer splits as a pair, "
                f"{first} 'column' and {second} 'row' (or neither)"
            )


@reference("parallelize")
def parallelize(block: Block, comm: Comm, plan: Mapping[str, str] = PLAN) -> Block:
    """A copy of block whose layers named in plan hold only this rank's shard (see the module's docstring)."""
    check_plan(plan)
    config = block.config
    split = copy.deepcopy(block)
    heads = head_range(config.n_head, comm)
    d = config.n_embd // config.n_head
    hidden = block_range(4 * config.n_embd, comm.Get_rank(), comm.Get_size())
    features = {
        "attn.qkv": qkv_rows(config.n_embd, config.n_head, heads),
        "attn.proj": torch.arange(heads.start * d, heads.stop * d),
        "mlp.fc": torch.arange(hidden.start, hidden.stop),
        "mlp.proj": torch.arange(hidden.start, hidden.stop),
    }
    for name, kind in plan.items():
        owner, _, child = name.rpartition(".")
        parent = split.get_submodule(owner)
        linear = cast(nn.Linear, getattr(parent, child))
        layer = ColumnParallelLinear if kind == "column" else RowParallelLinear
        setattr(parent, child, layer(linear, features[name], comm))
    if "attn.qkv" in plan:
        split.attn.heads = heads
    return split


class SequenceParallelBlocks(nn.Module):
    """A GPT's split blocks run one after the other sequence parallel: the whole (B, T, n_embd) in, the same on
    every rank; this rank's rows through every block (`block_forward`); the whole out (see the module's docstring)."""

    def __init__(self, blocks: list[nn.Module], comm: Comm, block_forward: SequenceBlock):
        super().__init__()
        self.parts = nn.ModuleList(BlockParts(block) for block in blocks)
        self.comm, self.block_forward = comm, block_forward

    def forward(self, x: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        length, size = x.shape[1], self.comm.Get_size()
        if length < size:
            raise ValueError(f"a sequence of {length} tokens cannot be split over {size} ranks")
        rows = Scatter.apply(x, self.comm)
        for parts in self.parts:
            rows = self.block_forward(rows, cast(BlockParts, parts), self.comm, seed, length)
        return Gather.apply(rows, self.comm, length, True)


class VocabParallelGPT(nn.Module):
    """A GPT whose blocks are already split, with its vocabulary split too: this rank's rows of the token
    embedding (`VocabParallelEmbedding`), which are also the tied output layer's, and the loss by `vocab_loss` on
    this rank's logits (B, T, V_r), never gathered. The position embedding and the LayerNorms stay whole."""

    def __init__(self, model: GPT, comm: Comm, vocab_loss: VocabLoss):
        super().__init__()
        if model.lm_head is not None:
            raise ValueError("VocabParallelGPT splits a GPT with tied embeddings (GPTConfig(tied=True))")
        self.config, self.comm, self.vocab_loss = model.config, comm, vocab_loss
        self.wte = VocabParallelEmbedding(model.wte, comm)
        self.wpe, self.blocks, self.ln_f = model.wpe, model.blocks, model.ln_f

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, seed: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) whole on every rank -> this rank's logits (B, T, V_r), and the mean loss if targets."""
        if self.training and self.config.dropout > 0 and seed is None:
            raise ValueError("training with dropout needs seed= (e.g. the step number): the masks are drawn from it")
        seed = seed if self.training else None
        x = seeded_dropout(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])), self.config.dropout, seed, 0)
        for block in self.blocks:
            x = block(x, seed)
        # f: every rank's logits need the whole x; backward sums the parts of its gradient that each vocabulary block made
        logits = F.linear(Copy.apply(self.ln_f(x), self.comm), self.wte.weight)
        if targets is None:
            return logits, None
        return logits, self.vocab_loss(logits.flatten(0, 1), targets.flatten(), self.comm, self.wte.vocab.start)


def parallelize_gpt(
    model: GPT,
    comm: Comm,
    plan: Mapping[str, str] = PLAN,
    parallelize_block: Parallelize = parallelize,
    sequence_parallel: SequenceBlock | None = None,
    vocab_loss: VocabLoss | None = None,
) -> nn.Module:
    """A copy of model with every block replaced by parallelize_block(block, comm, plan) (yours or the library's);
    with `sequence_parallel` (`sequence_parallel_block`, or yours) the split blocks run sequence parallel by it,
    as one module (`SequenceParallelBlocks`, the only entry of the copy's `blocks`); with `vocab_loss`
    (`vocab_parallel_cross_entropy`, or yours) the vocabulary is split too (a `VocabParallelGPT`)."""
    split = copy.deepcopy(model)
    blocks = [parallelize_block(cast(Block, b), comm, plan) for b in model.blocks]
    split.blocks = nn.ModuleList(
        blocks if sequence_parallel is None else [SequenceParallelBlocks(blocks, comm, sequence_parallel)]
    )
    return split if vocab_loss is None else VocabParallelGPT(split, comm, vocab_loss)

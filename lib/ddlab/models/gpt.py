"""A small GPT (lab 14): decoder-only transformer, written to be read and then split over ranks.

The architecture is GPT-2's (Radford et al., "Language Models are Unsupervised Multitask
Learners", 2019), itself the decoder of Vaswani et al., "Attention Is All You Need" (2017):
token and position embeddings, `n_layer` blocks, a final LayerNorm and a linear layer back
to the vocabulary. Each block is pre-LayerNorm:

    x = x + dropout(attention(ln_1(x)))      attention: causal, n_head heads of n_embd / n_head
    x = x + dropout(mlp(ln_2(x)))            mlp: n_embd -> 4 n_embd, GELU, -> n_embd

Weights start as GPT-2's: normal with standard deviation 0.02, biases zero, and the two
projections that end on the residual stream scaled by 1/sqrt(2 n_layer) (GPT-2, section
2.3). `tied=True` uses the token embedding as the output layer too (GPT-2 does).

Dropout is seeded: `forward(idx, targets, seed=step)` draws every mask from a generator
seeded by (seed, site), where each place that drops (the embeddings, each block's attention
probabilities and its two residual branches) is a numbered site, and always draws the
whole tensor's mask. A rank that holds a slice of the tensor (a few heads, a stretch of the
sequence) draws the same whole mask and keeps its slice (`seeded_dropout(..., part=...)`),
so a split model drops exactly what one process drops. Tensors are (batch, sequence, n_embd).

Dropout is applied as `x.masked_fill(~keep, 0) * scale`, so autograd keeps the mask
(one byte per element) and not a scaled copy: what backward keeps is then what
Korthikanti et al. count (see `ddlab.tensor_parallel.formulas`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: Dropout sites: 0 for the embeddings, then three per block (attention probabilities, attention output, MLP output).
SITES_PER_BLOCK = 3

#: What gives a step's (inputs, targets), e.g. `ddlab.data.text.BatchSampler.batch_at`.
BatchAt = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class GPTConfig:
    """The GPT's sizes. The default is lab 14's: about 0.2 M parameters, a few hundred steps in well under a minute."""

    vocab_size: int = 256
    block_size: int = 64  # the longest sequence (position embeddings)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tied: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if min(self.vocab_size, self.block_size, self.n_layer, self.n_head) < 1:
            raise ValueError(f"every size must be positive: {self}")


def dropout_mask(shape: tuple[int, ...], p: float, seed: int, site: int) -> torch.Tensor:
    """The keep mask (bool) of a whole tensor at one dropout site: a function of (seed, site, shape) only."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + site)
    return torch.rand(shape, generator=generator) >= p


def seeded_dropout(
    x: torch.Tensor,
    p: float,
    seed: int | None,
    site: int,
    whole: tuple[int, ...] | None = None,
    part: tuple[slice, ...] = (),
) -> torch.Tensor:
    """Dropout of x with the mask of the whole tensor (shape `whole`, default x's) at `site`, sliced by `part`.

    seed None (evaluation) or p == 0 returns x itself.
    """
    if seed is None or p == 0:
        return x
    keep = dropout_mask(whole or tuple(x.shape), p, seed, site)[part]
    if keep.shape != x.shape:
        raise ValueError(f"the mask's part {tuple(keep.shape)} does not match the tensor {tuple(x.shape)}")
    return x.masked_fill(~keep, 0) * (1.0 / (1.0 - p))


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    heads: int,
    p: float,
    seed: int | None,
    site: int,
    all_heads: int | None = None,
    head_part: slice = slice(None),
    all_samples: int | None = None,
    sample_part: slice = slice(None),
) -> torch.Tensor:
    """Causal attention of `heads` heads: q, k, v (B, T, heads * d) -> (B, T, heads * d).

    The attention probabilities drop with the mask of `all_heads` heads (default `heads`) and
    `all_samples` samples (default B), of which these are `head_part` and `sample_part`: a rank
    holding some of the heads, or some of a batch's samples, drops what one process does.
    """
    batch, length, width = q.shape
    d = width // heads

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, length, heads, d).transpose(1, 2)  # (B, heads, T, d)

    scores = (split(q) @ split(k).transpose(-2, -1)) * (1.0 / math.sqrt(d))
    future = torch.full((length, length), float("-inf"), dtype=q.dtype).triu(1)
    probs = torch.softmax(scores + future, dim=-1)
    whole = (all_samples or batch, all_heads or heads, length, length)
    probs = seeded_dropout(probs, p, seed, site, whole, (sample_part, head_part))
    return (probs @ split(v)).transpose(1, 2).reshape(batch, length, width)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one linear layer for q, k and v (in that order), one projection.

    `heads` (all of them unless a tensor-parallel split sets fewer, `ddlab.tensor_parallel.parallelize`)
    are the heads this module computes: qkv gives their q, k and v, proj takes their features, and the
    attention probabilities drop with their part of the whole mask.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config, self.heads = config, range(config.n_head)
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor, seed: int | None, site: int) -> torch.Tensor:
        config, heads = self.config, self.heads
        q, k, v = self.qkv(x).split(len(heads) * (config.n_embd // config.n_head), dim=2)
        part = slice(heads.start, heads.stop)
        return self.proj(causal_attention(q, k, v, len(heads), config.dropout, seed, site, config.n_head, part))


class MLP(nn.Module):
    """n_embd -> 4 n_embd, GELU, -> n_embd."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(ln_1(x)), then + mlp(ln_2(x)), each branch dropped out."""

    def __init__(self, config: GPTConfig, index: int):
        super().__init__()
        self.config, self.site = config, 1 + SITES_PER_BLOCK * index
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        p = self.config.dropout
        x = x + seeded_dropout(self.attn(self.ln_1(x), seed, self.site), p, seed, self.site + 1)
        return x + seeded_dropout(self.mlp(self.ln_2(x)), p, seed, self.site + 2)


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size), and the mean cross-entropy if targets are given."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = None if config.tied else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif name.startswith("ln") or ".ln_" in name:
                nn.init.ones_(param)
            else:
                residual = name.endswith("proj.weight")
                nn.init.normal_(param, 0.0, 0.02 / math.sqrt(2 * config.n_layer) if residual else 0.02)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output layer's weight (vocab_size, n_embd): the token embedding's when tied."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, seed: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """seed: the dropout masks' seed (e.g. the step number); needed when training with dropout."""
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"a sequence of {idx.shape[1]} tokens is longer than block_size={self.config.block_size}")
        if self.training and self.config.dropout > 0 and seed is None:
            raise ValueError("training with dropout needs seed= (e.g. the step number): the masks are drawn from it")
        seed = seed if self.training else None
        positions = torch.arange(idx.shape[1])
        x = seeded_dropout(self.wte(idx) + self.wpe(positions), self.config.dropout, seed, 0)
        for block in self.blocks:
            x = block(x, seed)
        logits = F.linear(self.ln_f(x), self.output_weight)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_gpt(config: GPTConfig | None = None, seed: int = 0, dtype: torch.dtype = torch.float32) -> GPT:
    """A GPT whose initial weights depend only on `seed` (torch's global generator is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config or GPTConfig())
    return model.to(dtype)


def train_gpt(model: GPT, batch_at: BatchAt, steps: int, lr: float = 3e-3, start: int = 0) -> list[float]:
    """AdamW for `steps` steps on batch_at(step) for step = start, start + 1, ...; the training losses.

    The step number seeds the dropout masks.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(start, start + steps):
        x, y = batch_at(step)
        _, loss = model(x, y, seed=step)
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def evaluate(model: GPT, batch_at: BatchAt, batches: int = 8) -> float:
    """Mean loss over batch_at(0 .. batches - 1), dropout off."""
    was_training = model.training
    model.eval()
    total = 0.0
    for step in range(batches):
        x, y = batch_at(step)
        _, loss = model(x, y)
        assert loss is not None
        total += float(loss)
    model.train(was_training)
    return total / batches


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, new_tokens: int, seed: int = 0, temperature: float = 1.0) -> torch.Tensor:
    """idx (B, T) followed by new_tokens tokens sampled one at a time (the last block_size tokens as context)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    for _ in range(new_tokens):
        logits, _ = model(idx[:, -model.config.block_size :])
        probs = torch.softmax(logits[:, -1] / temperature, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    model.train(was_training)
    return idx

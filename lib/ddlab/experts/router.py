"""The router of a mixture of experts: top-k gates, capacity, dropped tokens, the balancing loss (lab 15).

A linear gate scores each token against every expert, softmax over experts (Shazeer et
al., "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts Layer",
2017). Each token goes to its k best experts: with k = 1 its weight is the winner's
probability (Fedus et al., "Switch Transformers", 2022), with k = 2 the two
probabilities renormalised to sum to 1 (Lepikhin et al., "GShard", 2020).

Each expert takes at most `capacity` of this rank's assignments:
capacity = ceil(capacity_factor * k * tokens / experts). Assignments are served first
choices first (all tokens' first choices in token order, then the second choices, as
GShard does), and those past an expert's capacity are dropped: the token then skips the
layer on that slot (the residual connection carries it). The capacity is per rank, from
the rank's own tokens, so routing needs no message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..runtime.reference import reference


@dataclass
class Routing:
    """Where this rank's kept assignments go: one entry per (token, choice) that fits in its expert."""

    token: torch.Tensor  # (n,) int64: the token each kept assignment takes
    expert: torch.Tensor  # (n,) int64: its expert
    weight: torch.Tensor  # (n,) the gate weight its expert's output is scaled by (carries the gate's gradient)
    dropped: int  # assignments past their expert's capacity
    capacity: int  # assignments one expert takes at most
    load: torch.Tensor  # (experts,) int64: assignments each expert was given before dropping
    aux_loss: torch.Tensor  # Switch Transformer's load-balancing loss (a scalar)


def capacity(tokens: int, experts: int, k: int, capacity_factor: float) -> int:
    """Assignments one expert takes at most: ceil(capacity_factor * k * tokens / experts)."""
    if capacity_factor <= 0:
        raise ValueError(f"the capacity factor must be positive, got {capacity_factor}")
    return math.ceil(capacity_factor * k * tokens / experts)


def balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss: N * sum_i f_i P_i (Fedus et al. 2022, eq. 4, without alpha).

    f_i: the fraction of tokens whose first choice is expert i (no gradient); P_i: the mean
    router probability of expert i. It is 1 when both are uniform and grows as the load
    concentrates on a few experts, which the gradient through P_i discourages.
    """
    experts = probs.shape[1]
    fraction = torch.bincount(first_choice, minlength=experts).to(probs.dtype) / max(len(first_choice), 1)
    return experts * torch.sum(fraction * probs.mean(0))


@reference("route")
def route(logits: torch.Tensor, k: int, capacity_factor: float) -> Routing:
    """Top-k routing of tokens (logits: (tokens, experts)) with a capacity; see the module's docstring."""
    tokens, experts = logits.shape
    if k not in (1, 2) or k > experts:
        raise ValueError(f"k must be 1 or 2 (and at most the {experts} experts), got {k}")
    probs = F.softmax(logits, dim=-1)
    top, chosen = probs.topk(k, dim=-1)  # (tokens, k)
    weights = top if k == 1 else top / top.sum(-1, keepdim=True)
    limit = capacity(tokens, experts, k, capacity_factor)
    expert = chosen.t().reshape(-1)  # first choices of every token, then second choices
    token = torch.arange(tokens).repeat(k)
    slot = torch.zeros_like(expert)  # the assignment's place in its expert's queue
    for e in expert.unique().tolist():
        mine = expert == e
        slot[mine] = torch.arange(int(mine.sum()))
    kept = slot < limit
    return Routing(
        token=token[kept],
        expert=expert[kept],
        weight=weights.t().reshape(-1)[kept],
        dropped=int((~kept).sum()),
        capacity=limit,
        load=torch.bincount(expert, minlength=experts),
        aux_loss=balancing_loss(probs, chosen[:, 0]),
    )

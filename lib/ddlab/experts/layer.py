"""A mixture-of-experts MLP for lab 14's GPT, its experts spread over ranks (lab 15).

`MoE(n_embd, n_experts, k, capacity_factor, comm)` replaces a block's MLP: a gate
routes each token to k of `n_experts` MLPs (`router.route`), each the GPT's MLP
(n_embd -> hidden -> n_embd, GELU). With comm=None (the dense fallback) one process
holds every expert; with a communicator of P ranks each rank holds E/P of them, its
tokens travel to their experts and back by `dispatch.ExchangeRows` (Alltoallv, its
backward the reverse Alltoallv), and each rank computes the layer for its own tokens.
The gate is replicated; every weight is drawn from (seed, expert), so the distributed
layer and the dense fallback hold the same weights, and since capacities come from each
rank's own tokens they drop the same assignments: a rank's output equals the fallback's
on the same tokens.

After each forward, `routing` holds the last routing (`router.Routing`), and `aux_loss`
(Switch Transformer's balancing loss), `dropped` and `load` come from it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from ..models.gpt import GPT
from .dispatch import ExchangeRows, dispatch_plan, experts_per_rank
from .router import Routing, route


class Expert(nn.Module):
    """n_embd -> hidden -> n_embd with GELU between: the GPT's MLP."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden)
        self.proj = nn.Linear(hidden, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def _seeded(module: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Normal(0, std) weights and zero biases from a generator seeded by `seed` alone."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "weight" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            else:
                param.zero_()
    return module


class MoE(nn.Module):
    """Top-k mixture of `n_experts` MLPs; on P ranks, E/P experts per rank and two Alltoallvs per pass."""

    def __init__(
        self,
        n_embd: int,
        n_experts: int,
        k: int = 1,
        capacity_factor: float = 1.25,
        comm: MPI.Comm | None = None,
        hidden: int | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.comm, self.n_experts, self.k, self.capacity_factor = comm, n_experts, k, capacity_factor
        size, rank = (comm.Get_size(), comm.Get_rank()) if comm is not None else (1, 0)
        local = experts_per_rank(n_experts, size)
        self.first = rank * local  # global id of this rank's first expert
        hidden = hidden or 4 * n_embd
        self.gate = _seeded(nn.Linear(n_embd, n_experts, bias=False), seed).to(dtype)
        self.experts = nn.ModuleList(
            _seeded(Expert(n_embd, hidden), seed * 1_000_003 + self.first + j + 1).to(dtype) for j in range(local)
        )
        self._routing: Routing | None = None

    @property
    def routing(self) -> Routing:
        """The routing of the last forward."""
        if self._routing is None:
            raise RuntimeError("this MoE layer has not run a forward yet: its routing is not known")
        return self._routing

    @property
    def aux_loss(self) -> torch.Tensor:
        """The last forward's balancing loss (Switch Transformer's, without alpha)."""
        return self.routing.aux_loss

    @property
    def dropped(self) -> int:
        """Assignments the last forward dropped at capacity."""
        return self.routing.dropped

    @property
    def load(self) -> torch.Tensor:
        """Assignments each expert was given in the last forward, before dropping."""
        return self.routing.load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., n_embd) -> the same shape: each token's experts' outputs, weighted by its gates."""
        tokens = x.reshape(-1, x.shape[-1])
        routing = self._routing = route(self.gate(tokens), self.k, self.capacity_factor)
        rows = tokens[routing.token]
        if self.comm is None:
            out = self._apply_experts(rows, routing.expert)
        else:
            plan = dispatch_plan(self.comm, routing.expert.numpy(), self.n_experts)
            arrived = ExchangeRows.apply(rows, self.comm, plan.send, plan.received)
            done = self._apply_experts(arrived, torch.from_numpy(plan.local_expert()) + self.first)
            back = ExchangeRows.apply(done, self.comm, plan.returns(), plan.sent)
            inverse = np.empty_like(plan.order)
            inverse[plan.order] = np.arange(len(plan.order))
            out = back[torch.from_numpy(inverse)]  # row i of back is the result of row order[i]
        y = torch.zeros_like(tokens).index_add(0, routing.token, routing.weight[:, None] * out)
        return y.reshape(x.shape)

    def _apply_experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Each row through its expert (global ids, all held here), results in the rows' order.

        Every expert runs, on no rows too: the results then stay in autograd's graph even when no row
        reached this rank, so its backward runs the two Alltoallvs its peers run (skipping them hung the
        expert group), and an expert given no row gets a zero gradient."""
        out = torch.zeros_like(rows)
        for j, module in enumerate(self.experts):
            mine = torch.nonzero(expert == self.first + j).flatten()
            out = out.index_copy(0, mine, module(rows[mine]))
        return out


def use_experts(
    model: GPT,
    n_experts: int,
    k: int = 1,
    capacity_factor: float = 1.25,
    comm: MPI.Comm | None = None,
    every: int = 1,
    seed: int = 0,
) -> list[MoE]:
    """Replace the MLP of every `every`-th block of a GPT by a MoE layer (in place); the layers put in."""
    config, dtype = model.config, next(model.parameters()).dtype
    layers = []
    for index, block in enumerate(model.blocks):
        if index % every == every - 1:
            block.mlp = MoE(config.n_embd, n_experts, k, capacity_factor, comm, seed=seed * 101 + index, dtype=dtype)
            layers.append(block.mlp)
    return layers


def aux_loss(layers: list[MoE]) -> torch.Tensor:
    """The sum of the layers' balancing losses from their last forward (add alpha times it to the loss)."""
    return torch.stack([layer.aux_loss for layer in layers]).sum()

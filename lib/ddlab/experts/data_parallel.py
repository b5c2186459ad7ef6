"""Experts with data parallelism (lab 15): experts spread over the ranks of an expert group, each
expert group a replica of the others, as expert parallelism is used.

The world of W ranks is a grid of W/G replicas of G expert ranks (`expert_and_data_groups`): rank
w is expert rank w mod G of replica w // G. Within a replica the MoE layers' tokens travel by
all-to-all (the layer's `comm` is the expert group); the ranks holding the same experts in
different replicas form a data group. Each rank's loss is the mean over its own tokens, the
global loss the mean over the W ranks, so after backward (`average_gradients`):

- a non-expert parameter (the gate, everything outside the experts) is replicated on every rank,
  and its gradient is the sum over the W ranks' divided by W (an Allreduce over the world);
- an expert's gradient already sums the contributions of every token of its replica (the
  all-to-all's backward brought them), so it is summed over the data group only, divided by W.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from .layer import MoE


def expert_and_data_groups(comm: MPI.Comm, expert_ranks: int) -> tuple[MPI.Comm, MPI.Comm]:
    """(expert group, data group) of this rank: its replica's G ranks, and the ranks holding its experts."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if expert_ranks < 1 or size % expert_ranks:
        raise ValueError(f"{size} ranks cannot form replicas of {expert_ranks} expert ranks: use a divisor of {size}")
    experts = comm.Split(rank // expert_ranks, rank)
    data = comm.Split(rank % expert_ranks, rank)
    return experts, data


def expert_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters that belong to some MoE layer's experts (not its gate)."""
    return {id(p) for module in model.modules() if isinstance(module, MoE) for p in module.experts.parameters()}


def average_gradients(model: nn.Module, world: MPI.Comm, data: MPI.Comm) -> None:
    """Each gradient summed where its parameter is replicated and divided by the world's size (see the module)."""
    experts, size = expert_parameters(model), world.Get_size()
    for param in model.parameters():
        if param.grad is None:  # a parameter the forward did not use: zero here, maybe not on its peers
            param.grad = torch.zeros_like(param)
        buffer = param.grad.detach().contiguous().numpy()
        (data if id(param) in experts else world).Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        param.grad.copy_(torch.from_numpy(buffer) / size)


def train_with_experts(
    world: MPI.Comm,
    expert_ranks: int,
    steps: int,
    alpha: float,
    seed: int = 0,
    capacity_factor: float = 1.25,
) -> tuple[list[float], np.ndarray]:
    """Lab 14's small GPT with MoE MLPs (8 experts, k = 1) on replicas of `expert_ranks` ranks, trained.

    Each of the world's ranks draws its own batches of lab 14's text (16 x 32 tokens), adds `alpha` times
    the balancing loss (Switch Transformer's; alpha = 0 leaves it out), averages the gradients as
    `average_gradients` does and takes an AdamW step. Returns (the language loss per step, averaged over the
    world; the experts' load on 4 validation batches, assignments per expert before dropping, summed over
    the world's tokens, one row per MoE layer)."""
    from ..data.text import BatchSampler, make_corpus
    from ..models.gpt import GPTConfig, make_gpt
    from .layer import aux_loss, use_experts

    experts, data = expert_and_data_groups(world, expert_ranks)
    try:
        config = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=32)
        model = make_gpt(config, seed=seed)
        layers = use_experts(model, n_experts=8, k=1, capacity_factor=capacity_factor, comm=experts, seed=seed)
        corpus = make_corpus(seed=0)
        train = BatchSampler(corpus.train, 16, config.block_size, seed=1000 * (seed + 1) + world.Get_rank())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(steps):
            x, y = train.batch_at(step)
            _, loss = model(x, y)
            assert loss is not None
            optimizer.zero_grad()
            (loss + alpha * aux_loss(layers) if alpha else loss).backward()
            average_gradients(model, world, data)
            optimizer.step()
            losses.append(world.allreduce(loss.item()) / world.Get_size())
        val = BatchSampler(corpus.val, 16, config.block_size, seed=7 + world.Get_rank())
        load = np.zeros((len(layers), 8), dtype=np.int64)
        with torch.no_grad():
            for b in range(4):
                model(val.batch_at(b)[0])
                load += np.stack([layer.load.numpy() for layer in layers])
        world.Allreduce(MPI.IN_PLACE, load, op=MPI.SUM)
        return losses, load
    finally:
        experts.Free()
        data.Free()

"""ZeRO-1 as an optimizer: any torch.optim class, its state kept for this rank's shard only.

    optimizer = ShardedOptimizer(model.parameters(), torch.optim.Adam, comm, lr=1e-3)
    loss_fn(model(x), y).backward()   # each rank its own batch; full gradients, as in DDP
    optimizer.step()                  # reduce-scatter, the inner optimizer on one shard, allgather

All trainable parameters are laid end to end in one padded flat buffer cut into P equal
shards (`FlatSpace`). Rank r keeps a copy of shard r (its master shard) and builds the inner
optimizer over it alone, so Adam's two moments take 1/P of what data parallelism keeps
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, stage 1, P_os). A step reduce-scatters the flat gradient (rank r gets the
sum of shard r), divides by P (the mean of the ranks' gradients, as data parallelism),
steps the inner optimizer, and allgathers the shards into every rank's parameters: the
bytes of one ring allreduce. Element-wise optimizers (SGD, Adam, AdamW, RMSprop, ...) then
reach exactly what one process reaches on the global batch; one that looks across the whole
tensor (LBFGS, or gradient clipping by global norm) would see only a shard.

This is the reference for lab 13's exercise 13.3; `Sharded` (zero.py) does the same per
unit, with the gradients and parameters sharded too. `master_dtype` keeps the master shard in
another dtype than the parameters' (lab 18's `ddlab.precision.MixedShardedOptimizer`: bfloat16
parameters, a float32 master shard); by default it is the parameters' own.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..runtime.comm import Comm
from ..runtime.reference import reference
from .collectives import CollectivesChoice, resolve_collectives
from .flat import FlatSpace


@reference("sharded_optimizer")
class ShardedOptimizer:
    """`optimizer_class(shard, **kwargs)` over this rank's shard of `params`, which are alike on every rank of `comm`.

    collectives: "mpi", "ring" or a (reduce_scatter, allgather) pair (see collectives.py); master_dtype: the
    master shard's dtype (None: the parameters').
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        optimizer_class: type[torch.optim.Optimizer],
        comm: Comm,
        collectives: CollectivesChoice = "mpi",
        master_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ShardedOptimizer got no parameters that require a gradient")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or not self.params[0].is_floating_point():
            raise ValueError(f"the parameters must share one floating dtype, got {dtypes}")
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.reduce_scatter, self.allgather = resolve_collectives(collectives)
        self.space = FlatSpace.of(self.params, self.size)
        flat = self.space.flatten([p.detach() for p in self.params], master_dtype or self.params[0].dtype)
        self.shard = nn.Parameter(self.space.shard(flat, self.rank).clone())
        self.optimizer = optimizer_class([self.shard], **kwargs)

    def zero_grad(self) -> None:
        """Forget the parameters' gradients (set to None, as torch's optimizers do by default)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Reduce-scatter the mean gradient, step the inner optimizer on this rank's shard, allgather."""
        grads = self.space.flatten([p.grad for p in self.params], self.shard.dtype)
        summed = self.reduce_scatter(self.comm, grads.numpy(), self.space.bounds)
        self.shard.grad = torch.from_numpy(summed).div_(self.size)
        self.optimizer.step()
        gathered = self.allgather(self.comm, self.shard.detach().numpy(), self.space.bounds)
        for p, view in zip(self.params, self.space.views(torch.from_numpy(gathered))):
            p.copy_(view)

    def state_bytes(self) -> int:
        """Bytes of the inner optimizer's state on this rank (its master shard excluded)."""
        return sum(
            t.numel() * t.element_size()
            for state in self.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )

"""bfloat16 mixed precision with float32 masters, in lab 13's sharded optimizer (lab 18).

The model computes in bfloat16: its parameters, activations and gradients are bfloat16 (2 bytes
each). The optimizer keeps, for this rank's shard only, a float32 master copy and Adam's two
float32 moments (12 bytes). ZeRO counts these 2 + 2 + 12 = 16 bytes per parameter (Rajbhandari et
al., "ZeRO", SC 2020, section 3.1: K = 12 for mixed-precision Adam); sharding the optimizer's part
over P ranks leaves 2 + 2 + 12 / P. A step, at each moment:

1. the bfloat16 gradients, flattened into float32 (exact: every bfloat16 value is a float32 one);
2. reduce-scattered in float32 (a bfloat16 sum over P ranks would lose up to P * 2^-8, see
   reduction.py) and divided by P: this rank's mean gradient shard, float32;
3. the inner optimizer steps the float32 master shard;
4. the master shard rounded to bfloat16 and allgathered as bfloat16 bits (2 bytes a parameter);
5. copied into the model's bfloat16 parameters.

`train_mixed` runs it over P ranks with each global batch cut into `blocks` blocks (P divides
`blocks`; each rank sums its blocks' gradients in float32), so one process with the same `blocks`
does exactly the same arithmetic: the tests compare the two.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..runtime.comm import Comm
from ..sharded.collectives import CollectivesChoice
from ..sharded.optimizer import ShardedOptimizer

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class MixedShardedOptimizer(ShardedOptimizer):
    """ZeRO-1 for bfloat16 parameters: float32 master shard and optimizer state, float32 reduction, bfloat16 gather.

    Its constructor is lab 13's `ShardedOptimizer`'s with a float32 master shard (`shard`); only the step differs."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        optimizer_class: type[torch.optim.Optimizer],
        comm: Comm,
        collectives: CollectivesChoice = "mpi",
        **kwargs: Any,
    ):
        trainable = [p for p in params if p.requires_grad]
        if not trainable or any(p.dtype != torch.bfloat16 for p in trainable):
            raise ValueError("MixedShardedOptimizer needs bfloat16 parameters: call model.to(torch.bfloat16) first")
        super().__init__(trainable, optimizer_class, comm, collectives, master_dtype=torch.float32, **kwargs)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor] | None = None) -> None:
        """One step from `grads` (float32, one per parameter; default: the parameters' bfloat16 .grad)."""
        flat = self.space.flatten(grads if grads is not None else [p.grad for p in self.params], torch.float32)
        summed = self.reduce_scatter(self.comm, flat.numpy(), self.space.bounds)
        self.shard.grad = torch.from_numpy(summed).div_(self.size)
        self.optimizer.step()
        bits = self.shard.detach().to(torch.bfloat16).view(torch.int16).numpy()
        gathered = torch.from_numpy(self.allgather(self.comm, bits, self.space.bounds)).view(torch.bfloat16)
        for p, view in zip(self.params, self.space.views(gathered)):
            p.copy_(view)

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds per category: bfloat16 parameters and gradients, float32 master and state."""
        state = sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        return {
            "parameters": sum(p.numel() * p.element_size() for p in self.params),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None),
            "optimizer": self.shard.numel() * 4 + state,
        }


def predicted_bytes_per_parameter(recipe: str, size: int) -> dict[str, float]:
    """Bytes per parameter one rank holds with Adam in lab 13's ZeRO-1 over `size` ranks, per part.

    "bfloat16": 2 + 2 + 12 / P (ZeRO's 2 + 2 + K with K = 12: the float32 master and two moments, sharded);
    "float32": 4 + 4 + 12 / P (the inner optimizer steps a float32 copy of the shard, and its two moments)."""
    table = {"float32": (4.0, 4.0, 12.0), "bfloat16": (2.0, 2.0, 12.0)}
    if recipe not in table:
        raise ValueError(f"no recipe {recipe!r}: use one of {sorted(table)}")
    params, grads, optimizer = table[recipe]
    return {"parameters": params, "gradients": grads, "optimizer": optimizer / size}


def train_mixed(
    comm: Comm,
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    blocks: int,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.Adam,
    **kwargs: Any,
) -> list[float]:
    """Train the bfloat16 `model` in place; each rank sums the float32 gradients of its blocks. Returns this rank's mean loss per step."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if blocks % size:
        raise ValueError(f"{blocks} blocks per global batch do not split over {size} ranks")
    optimizer = MixedShardedOptimizer(model.parameters(), optimizer_class, comm, **kwargs)
    per = blocks // size
    losses = []
    for x, y in batches:
        n = len(x) // blocks
        total: list[torch.Tensor] | None = None
        loss_sum = 0.0
        for b in range(rank * per, (rank + 1) * per):
            optimizer.zero_grad()
            loss = loss_fn(model(x[b * n : (b + 1) * n].to(torch.bfloat16)), y[b * n : (b + 1) * n].to(torch.bfloat16))
            loss.backward()
            loss_sum += float(loss.detach())
            grads = [p.grad.float() for p in optimizer.params]  # type: ignore[union-attr]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        assert total is not None
        optimizer.step([t * size / blocks for t in total])
        losses.append(loss_sum / per)
    return losses

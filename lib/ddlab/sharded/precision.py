"""Dynamic loss scaling, which float16 training needs and bfloat16 does not.

float16 has 5 exponent bits: gradients below about 6e-8 become zero. Multiplying the
loss by S multiplies every gradient by S and lifts them into range; the step then
divides by S in float32. Too large an S overflows to inf: then the step is skipped and
S halved; after `interval` good steps S doubles again, so S stays near the largest
that does not overflow (Micikevicius et al., "Mixed Precision Training", ICLR 2018,
section 3.2). bfloat16 has float32's 8 exponent bits, so its gradients do not
underflow and it needs no scaling (at the cost of 3 fewer mantissa bits than float16).

With sharded gradients each rank sees only its shard, so whether to skip is agreed
over the ranks (one small allreduce): all skip, or none.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from ..runtime.counting import underlying
from .zero import Sharded


class DynamicLossScale:
    """Loss scale S: `scale(loss).backward()`, then `step(optimizer)` unscales, steps or skips, adapts S."""

    def __init__(self, model: Sharded, initial: float = 2.0**16, factor: float = 2.0, interval: int = 2000):
        if initial <= 0 or factor <= 1 or interval < 1:
            raise ValueError(f"need initial > 0, factor > 1, interval >= 1; got {initial}, {factor}, {interval}")
        self.model, self.value, self.factor, self.interval = model, float(initial), factor, interval
        self.good_steps, self.skipped = 0, 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the shards' gradients and step, or skip if any rank's overflowed; True if it stepped."""
        shards = self.model.shards()
        finite = all(bool(torch.isfinite(s.grad).all()) for s in shards if s.grad is not None)
        comm = underlying(self.model.comm)
        if not comm.allreduce(finite, op=MPI.LAND):
            for shard in shards:
                shard.grad = None
            self.value /= self.factor
            self.good_steps, self.skipped = 0, self.skipped + 1
            return False
        for shard in shards:
            if shard.grad is not None:
                shard.grad.div_(self.value)
        optimizer.step()
        self.good_steps += 1
        if self.good_steps == self.interval:
            self.value *= self.factor
            self.good_steps = 0
        return True

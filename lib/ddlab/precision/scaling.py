"""Dynamic loss scaling agreed by every rank, and float16 data parallelism trained with it (lab 18).

float16 has 5 exponent bits: gradients below about 6e-8 flush to zero, above 65504 overflow to
inf. Multiplying the loss by S multiplies every gradient by S; the step divides by S in float32.
When a gradient overflows the step is skipped and S is divided by `factor`; after `interval`
clean steps in a row S is multiplied by `factor` (Micikevicius et al., "Mixed Precision
Training", ICLR 2018, section 3.2). Over data parallelism each rank sees its own gradients
(or shard of them): whether to skip must be one decision for all ranks, or one rank steps while
another does not and their parameters part. One small allreduce (a logical and of "all my
gradients are finite") agrees on it.

Exercise 18.1's signature (`loss_scale_step` is the reference):

    loss_scale_step(comm, grads, state) -> (unscaled, new_state)

`grads` a list of this rank's gradient tensors (float32, or float16 straight from a float16
backward), computed from a loss multiplied by `state.scale`; `state` a `LossScale`. If any rank's gradients hold an inf or a NaN, every rank
returns (None, state with scale / factor, good_steps 0, skipped + 1). Otherwise every rank
returns (a new list of new float32 tensors, each grad / scale computed in float32, and the state with good_steps + 1, or,
when that reaches `interval`, scale * factor and good_steps 0). `grads` and `state` are unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from ..runtime.comm import Comm
from ..runtime.counting import underlying
from ..runtime.reference import reference

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LossScale:
    """The scaler's state: the scale S, clean steps since S last changed, steps skipped so far."""

    scale: float = 2.0**16
    factor: float = 2.0
    interval: int = 2000
    good_steps: int = 0
    skipped: int = 0

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.factor > 1 and self.interval >= 1):
            raise ValueError(
                f"need scale > 0, factor > 1, interval >= 1; got {self.scale}, {self.factor}, {self.interval}"
            )


@reference("loss_scale_step")
def loss_scale_step(
    comm: Comm, grads: list[torch.Tensor], state: LossScale
) -> tuple[list[torch.Tensor] | None, LossScale]:
    """Skip and back off if any rank overflowed, else unscale and perhaps grow (see the module's docstring)."""
    finite = np.array([all(bool(torch.isfinite(g).all()) for g in grads)], dtype=np.int32)
    everywhere = np.empty_like(finite)
    comm.Allreduce(finite, everywhere, op=MPI.LAND)
    if not everywhere[0]:
        return None, replace(state, scale=state.scale / state.factor, good_steps=0, skipped=state.skipped + 1)
    unscaled = [g.float() / state.scale for g in grads]
    if state.good_steps + 1 == state.interval:
        return unscaled, replace(state, scale=state.scale * state.factor, good_steps=0)
    return unscaled, replace(state, good_steps=state.good_steps + 1)


ScaleStep = Callable[[Comm, list[torch.Tensor], LossScale], tuple[list[torch.Tensor] | None, LossScale]]


def float16_grads(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, scale: float
) -> list[torch.Tensor]:
    """Gradients of loss * scale through a float16 copy of `model` (forward and backward in float16), as float32."""
    half = copy.deepcopy(model).to(torch.float16)
    loss = loss_fn(half(x.to(torch.float16)), y.to(torch.float16)) * scale
    loss.backward()
    return [
        p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32) for p in half.parameters()
    ]


def train_float16(
    comm: Comm,
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    lr: float,
    state: LossScale,
    scale_step: ScaleStep = loss_scale_step,
) -> tuple[list[bool], LossScale]:
    """Data-parallel SGD in float16 with float32 masters (`model`, updated in place) and dynamic loss scaling.

    Each global batch is cut into P equal blocks; rank r computes its block's gradients in float16,
    `scale_step` agrees to skip or unscales them, and the unscaled gradients are averaged by an
    allreduce in float32. Returns which steps were taken (False: skipped) and the final state."""
    rank, size = comm.Get_rank(), comm.Get_size()
    taken = []
    for x, y in batches:
        if len(x) % size:
            raise ValueError(f"a global batch of {len(x)} samples does not split into {size} equal blocks")
        block = len(x) // size
        mine = slice(rank * block, (rank + 1) * block)
        grads = float16_grads(model, loss_fn, x[mine], y[mine], state.scale)
        unscaled, state = scale_step(comm, grads, state)
        taken.append(unscaled is not None)
        if unscaled is None:
            continue
        flat = torch.cat([g.reshape(-1) for g in unscaled]).numpy()
        total = np.empty_like(flat)
        underlying(comm).Allreduce(flat, total, op=MPI.SUM)
        _sgd(model, torch.from_numpy(total) / size, lr)
    return taken, state


def train_float16_one_process(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    lr: float,
    state: LossScale,
    blocks: int,
) -> tuple[list[bool], LossScale]:
    """The same run on one process: each global batch's `blocks` blocks one after another, summed."""
    taken = []
    for x, y in batches:
        size = len(x) // blocks
        grads = [
            float16_grads(model, loss_fn, x[b * size : (b + 1) * size], y[b * size : (b + 1) * size], state.scale)
            for b in range(blocks)
        ]
        unscaled, state = loss_scale_step(MPI.COMM_SELF, [g for block in grads for g in block], state)
        taken.append(unscaled is not None)
        if unscaled is None:
            continue
        count = len(grads[0])
        flat = [torch.cat([g.reshape(-1) for g in unscaled[b * count : (b + 1) * count]]) for b in range(blocks)]
        _sgd(model, sum(flat[1:], flat[0]) / blocks, lr)
    return taken, state


@torch.no_grad()
def _sgd(model: nn.Module, flat_grad: torch.Tensor, lr: float) -> None:
    offset = 0
    for p in model.parameters():
        p.sub_(lr * flat_grad[offset : offset + p.numel()].view_as(p))
        offset += p.numel()

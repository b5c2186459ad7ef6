"""Run a schedule's op list on real ranks: one stage of a chain of layers per rank (exercise 7.3).

Rank s holds stage s (any torch module that keeps the shape of its input). For
("F", i) it receives micro-batch i's activation from rank s-1 (rank 0 takes
inputs[i]), runs its layers, keeps the input and output backward will need, and
sends the output to rank s+1 (the last rank computes the loss instead). For
("B", i) it receives the gradient of that output from rank s+1 (the last rank
starts from its loss), runs backward, which adds micro-batch i's gradient into
the parameters' .grad, and sends the gradient of its input to rank s-1.

Messages are tagged with their micro-batch, and posted without waiting (lab 06's
`Mailbox`): under 1F1B two neighbours may each be sending to the other at the
same moment, which blocking sends would deadlock.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..model_parallel import Mailbox
from ..runtime.comm import Comm
from ..runtime.reference import reference
from .schedules import Op


def micro_batch_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage's loss of one micro-batch: squared error, summed (so micro-batches add up to the batch)."""
    return ((output - target) ** 2).sum()


@reference("run_schedule")
def run_schedule(
    comm: Comm,
    layers: nn.Module,
    ops: list[Op],
    inputs: list[torch.Tensor],
    targets: list[torch.Tensor],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = micro_batch_loss,
    activation: tuple[tuple[int, ...], torch.dtype] | None = None,
) -> list[float]:
    """Exercise 7.3's reference: run_schedule(comm, layers, ops, inputs, targets) -> losses.

    Rank r of comm runs stage r (`layers`) through `ops`; inputs[i] (used on rank 0)
    and targets[i] (used on the last rank) are micro-batch i's, and every activation
    has inputs[i]'s shape and dtype. Gradients accumulate in the parameters' .grad.
    Returns the micro-batch losses in micro-batch order on the last rank, [] elsewhere.

    Beyond the exercise (lab 16's GPT stages): `loss(output, target)` replaces the squared
    error, and `activation` = (shape, dtype) of what the stages send when it is not the
    inputs' (token ids in, float activations between stages).
    """
    mailbox = Mailbox(comm)
    rank, size = mailbox.rank, mailbox.size
    first, last = rank == 0, rank == size - 1
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    losses: dict[int, float] = {}
    for kind, i in ops:
        if kind == "F":
            shape, dtype = activation or (tuple(inputs[i].shape), inputs[i].dtype)
            x = inputs[i] if first else mailbox.take(shape, dtype, rank - 1, i).requires_grad_()
            y = layers(x)
            if last:
                y = loss(y, targets[i])
                losses[i] = y.item()
            else:
                mailbox.post(y, rank + 1, i)
            kept[i] = (x, y)
        elif kind == "B":
            x, y = kept.pop(i)
            y.backward(None if last else mailbox.take(tuple(y.shape), y.dtype, rank + 1, i))
            if not first:
                assert x.grad is not None, "a received activation requires grad"
                mailbox.post(x.grad, rank - 1, i)
        else:
            raise ValueError(f"unknown op {(kind, i)!r}: ops are ('F', i) or ('B', i)")
    mailbox.free()  # waits until every posted message has been received
    return [losses[i] for i in sorted(losses)]

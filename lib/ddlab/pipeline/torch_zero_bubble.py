"""torch's own zero-bubble schedules (torch.distributed.pipelining) on lab 17's stages, beside ddlab's.

`TorchZeroBubble(comm, models, m, schedule)` places two of the 2p stage modules on each rank and runs
torch's `ScheduleZBVZeroBubble` (schedule "ZBV": the V, rank r holding stages r and 2p - 1 - r, as
ddlab's `zb_v`) or `ScheduleInterleavedZeroBubble` ("interleaved": rank r holding stages r and p + r,
lab 16's placement) over gloo (`ddlab.data_parallel.init_gloo`: the rendezvous on 127.0.0.1). Both
split each backward into B and W themselves (torch's `stage_backward_input` and
`stage_backward_weight`). The loss of a micro-batch is lab 07's `micro_batch_loss` (a sum) and the
gradients are not scaled by 1/m, so they add up as ddlab's do: equal to one process's on the batch.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from ..data_parallel import init_gloo
from ..runtime.comm import Comm
from ..runtime.counting import underlying
from .executor import micro_batch_loss
from .zero_bubble import placed

#: schedule name -> (torch's class name, ddlab's placement of a rank's two chunks)
TORCH_SCHEDULES = {
    "ZBV": ("ScheduleZBVZeroBubble", "V"),
    "interleaved": ("ScheduleInterleavedZeroBubble", "interleaved"),
}


class TorchZeroBubble:
    """One rank's two stages in one of torch's zero-bubble schedules; `step(inputs, targets)` runs m micro-batches.

    models: all 2p stage modules, the same on every rank (this rank copies its two). Gradients add up in
    `self.chunks[c]`'s parameters; `step` returns the m losses on the rank holding the last stage
    (rank 0 in the V, rank p - 1 interleaved), [] elsewhere."""

    def __init__(
        self,
        comm: Comm,
        models: list[nn.Module],
        m: int,
        schedule: str = "ZBV",
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = micro_batch_loss,
    ):
        import torch.distributed.pipelining as pipelining

        if schedule not in TORCH_SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}: one of {', '.join(TORCH_SCHEDULES)}")
        raw = underlying(comm)
        self.rank, self.p = raw.Get_rank(), raw.Get_size()
        if len(models) != 2 * self.p:
            raise ValueError(f"{schedule} needs 2p = {2 * self.p} stage modules (two a rank), got {len(models)}")
        name, self.shape = TORCH_SCHEDULES[schedule]
        init_gloo(raw)
        self.indices = [placed(self.shape, self.p, self.rank, c) for c in range(2)]
        self.chunks = [copy.deepcopy(models[q]) for q in self.indices]
        stages = [
            pipelining.PipelineStage(chunk, q, 2 * self.p, torch.device("cpu"))
            for chunk, q in sorted(zip(self.chunks, self.indices), key=lambda pair: pair[1])
        ]
        self.schedule = getattr(pipelining, name)(stages, m, loss_fn=loss, scale_grads=False)

    def step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> list[float]:
        """One step on micro-batches inputs[i] (rows concatenated, torch splits them back); gradients accumulate."""
        first, last = 0 in self.indices, 2 * self.p - 1 in self.indices
        losses: list[torch.Tensor] = []
        args = (torch.cat(inputs),) if first else ()
        kwargs = {"target": torch.cat(targets), "losses": losses} if last else {}
        self.schedule.step(*args, **kwargs)
        return [float(value) for value in losses]

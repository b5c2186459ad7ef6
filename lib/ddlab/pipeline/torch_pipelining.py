"""PyTorch's own pipeline, torch.distributed.pipelining, on the same UNet stages, for comparison.

A `PipelineStage` receives only what the stage before it returns, so a skip
connection that jumps over stages has to be *relayed*: every stage in between
receives it and passes it on. `RelayStage` wraps a stage's layers that way. The
gloo process group comes from `ddlab.data_parallel.init_gloo`.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
from torch import nn

from ..data_parallel import init_gloo
from ..model_parallel import StagePlan, polite_barrier
from ..models.unet import UNet
from ..runtime.comm import Comm
from ..runtime.counting import underlying


class RelayStage(nn.Module):
    """Layers bounds[s]..bounds[s+1]-1 taking (x, *skips carried in) and returning (x, *skips carried on)."""

    def __init__(self, model: UNet, bounds: list[int], stage: int):
        super().__init__()
        self.layers = copy.deepcopy(nn.ModuleList(model.layers[bounds[stage] : bounds[stage + 1]]))
        plan = StagePlan(model, bounds, (model.in_channels, 2**model.depth, 2**model.depth))
        made = {layer.saves: plan.stage_of(i) for i, layer in enumerate(model.layers) if layer.saves}
        used = {layer.uses: plan.stage_of(j) for j, layer in enumerate(model.layers) if layer.uses}
        self.carried_in = sorted(name for name in made if made[name] < stage <= used[name])
        self.carried_on = sorted(name for name in made if made[name] <= stage < used[name])

    def forward(self, x: torch.Tensor, *carried: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        skips = dict(zip(self.carried_in, carried))
        for layer in self.layers:
            x = layer(x, skips)
        return (x, *(skips[name] for name in self.carried_on)) if self.carried_on else x


def forward_bytes(model: UNet, bounds: list[int], image_shape: tuple[int, ...], batch: int, relayed: bool) -> int:
    """Bytes all stages send in one forward pass: direct skips (ddlab) or relayed ones (torch)."""
    plan = StagePlan(model, bounds, image_shape)
    size = next(model.parameters()).element_size() * batch
    total = 0
    for edge in plan.edges:
        hops = edge.dst - edge.src if relayed and edge.name != "x" else 1
        total += hops * torch.Size(edge.shape).numel() * size
    return total


class TorchPipeline:
    """One rank's stage in torch.distributed.pipelining: `step(images, masks)` trains on m micro-batches.

    schedule: "GPipe" or "1F1B". Gradients are scaled so that they equal the whole batch's.
    """

    def __init__(self, comm: Comm, model: UNet, bounds: list[int], m: int, schedule: str = "1F1B"):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        init_gloo(underlying(comm))
        self.rank, self.k = comm.Get_rank(), comm.Get_size()
        self.module = RelayStage(model, bounds, self.rank)
        stage = PipelineStage(self.module, self.rank, self.k, torch.device("cpu"))
        kind = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
        self.schedule = kind(stage, m, loss_fn=lambda logits, masks: nn.functional.cross_entropy(logits, masks))

    def step(self, images: torch.Tensor, masks: torch.Tensor) -> float | None:
        """One training step (gradients accumulate in self.module); the mean loss on the last rank."""
        if self.rank == 0:
            self.schedule.step(images)
        elif self.rank == self.k - 1:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=masks, losses=losses)
            return float(sum(loss.item() for loss in losses) / len(losses))
        else:
            self.schedule.step()
        return None

    def gradient_error(self, reference: list[list[torch.Tensor]], bounds: list[int]) -> float:
        """Largest |gradient - reference| over this rank's parameters."""
        worst = 0.0
        for layer, grads in zip(self.module.layers, reference[bounds[self.rank] : bounds[self.rank + 1]]):
            for param, want in zip(layer.parameters(), grads):
                if param.grad is None:
                    return float("inf")
                worst = max(worst, float((param.grad - want).abs().max()))
        return worst


def alternate_wall_times(comm: Comm, steps: dict[str, Callable[[], Any]], repeats: int = 3) -> dict[str, list[float]]:
    """Wall seconds of each contender's step, taking turns `repeats` times (a collective).

    Each step starts after a barrier and ends when its last rank finishes; taking
    turns spreads the machine's other work over all contenders alike.
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            polite_barrier(comm, pause=1e-4)
            start = time.perf_counter()
            step()
            times[name].append(max(underlying(comm).allgather(time.perf_counter())) - start)
    return times

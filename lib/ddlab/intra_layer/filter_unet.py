"""The lab's UNet with every 3x3 convolution filter parallel: weights split, activations whole.

Each rank keeps its output channels of every `Conv` layer's weights and a full copy of
the rest (the transposed convolutions and the 1x1 head, small). Every rank ends with
the whole output, so the loss, and the gradients of the replicated layers, are the same
on every rank: no gradient needs averaging. The memory this saves is the weights';
the activations stay whole on every rank.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..models.unet import Conv, Layer, Skips, UNet
from ..runtime.comm import Comm
from .channels import FilterParallelConv, filter_slice


class FilterConv(Layer):
    """A `Conv` layer (3x3 convolution and ReLU) holding this rank's output channels only."""

    def __init__(self, conv: nn.Conv2d, comm: Comm):
        super().__init__()
        self.weight, self.bias = filter_slice(conv, comm)
        self.comm, self.padding = comm, conv.padding

    def forward(self, x: torch.Tensor, skips: Skips) -> torch.Tensor:
        return torch.relu(FilterParallelConv.apply(x, self.weight, self.bias, self.comm, self.padding))


class FilterUNet(nn.Module):
    """`model` with its Conv layers filter parallel over comm's ranks (a collective to build: none)."""

    def __init__(self, model: UNet, comm: Comm):
        super().__init__()
        self.layers = nn.ModuleList(
            FilterConv(layer.conv, comm) if isinstance(layer, Conv) else copy.deepcopy(layer) for layer in model.layers
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips: Skips = {}
        for layer in self.layers:
            x = layer(x, skips)
        return x


def filter_step(
    net: FilterUNet, images: torch.Tensor, masks: torch.Tensor, optimizer: torch.optim.Optimizer | None = None
) -> float:
    """One step on the whole batch (every rank sees all of it). Returns the mean loss."""
    loss = nn.functional.cross_entropy(net(images), masks)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return loss.item()

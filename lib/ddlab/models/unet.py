"""A small UNet written as a flat list of layers, so it can be cut into stages anywhere.

Ronneberger, Fischer and Brox, "U-Net: Convolutional Networks for Biomedical Image
Segmentation" (2015): an encoder halves the image and doubles the channels level by
level, a decoder does the reverse, and long *skip connections* carry each encoder
level's output to the decoder level of the same size. Written as one list, a layer
either passes `x` on, stores a skip (`saves`) or concatenates one (`uses`); a split
into stages then sees exactly which skips cross from one stage to another.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch
from torch import nn

Skips = dict[str, torch.Tensor]


class Layer(nn.Module):
    """One step of the UNet: `forward(x, skips)` returns the next x.

    `saves` names the skip this layer stores (its input), `uses` the skip it takes.
    """

    saves: str | None = None
    uses: str | None = None


class Conv(Layer):
    """3x3 convolution (same size out) and ReLU."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x: torch.Tensor, skips: Skips) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Down(Layer):
    """Store x as a skip for the decoder, then halve the image (2x2 max pooling)."""

    saves: str

    def __init__(self, level: int):
        super().__init__()
        self.saves = f"skip{level}"

    def forward(self, x: torch.Tensor, skips: Skips) -> torch.Tensor:
        skips[self.saves] = x
        return nn.functional.max_pool2d(x, 2)


class Up(Layer):
    """Double the image (2x2 transposed convolution), then concatenate the skip of that size."""

    uses: str

    def __init__(self, level: int, cin: int, cout: int):
        super().__init__()
        self.uses = f"skip{level}"
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)

    def forward(self, x: torch.Tensor, skips: Skips) -> torch.Tensor:
        return torch.cat([self.up(x), skips.pop(self.uses)], dim=1)


class Head(Layer):
    """1x1 convolution to one score per class and pixel."""

    def __init__(self, cin: int, classes: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, classes, 1)

    def forward(self, x: torch.Tensor, skips: Skips) -> torch.Tensor:
        return self.conv(x)


class UNet(nn.Module):
    """UNet of `depth` levels, `width` channels at the top level, as `self.layers` in order.

    Image sides must be multiples of 2**depth. Layers per level: encoder Conv, Conv,
    Down; bottleneck Conv, Conv; decoder Up, Conv, Conv; then a Head: 6*depth + 3 in all.
    """

    layers: Sequence[Layer]  # an nn.ModuleList (so torch sees the parameters), typed by what it holds

    def __init__(self, in_channels: int = 3, classes: int = 3, width: int = 8, depth: int = 3):
        super().__init__()
        if depth < 1 or width < 1:
            raise ValueError(f"need depth >= 1 and width >= 1, got depth={depth}, width={width}")
        self.depth, self.in_channels = depth, in_channels
        channels = [width * 2**level for level in range(depth + 1)]
        layers: list[Layer] = []
        cin = in_channels
        for level in range(depth):
            layers += [Conv(cin, channels[level]), Conv(channels[level], channels[level]), Down(level)]
            cin = channels[level]
        layers += [Conv(cin, channels[depth]), Conv(channels[depth], channels[depth])]
        for level in reversed(range(depth)):
            layers += [
                Up(level, channels[level + 1], channels[level]),
                Conv(2 * channels[level], channels[level]),
                Conv(channels[level], channels[level]),
            ]
        layers.append(Head(channels[0], classes))
        self.layers = cast("Sequence[Layer]", nn.ModuleList(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = x.shape[-1]
        if x.shape[-2] % 2**self.depth or side % 2**self.depth:
            raise ValueError(f"image sides must be multiples of 2**depth = {2**self.depth}, got {tuple(x.shape[-2:])}")
        return run_layers(self.layers, x, {})


def run_layers(layers: Iterable[Layer], x: torch.Tensor, skips: Skips) -> torch.Tensor:
    """Run layers in order on x; `skips` is read and filled as the layers say."""
    for layer in layers:
        x = layer(x, skips)
    return x


def layer_names(model: UNet) -> list[str]:
    """Short labels for the layers, for tables and figures (e.g. 'Conv', 'Down0', 'Up0')."""
    names = []
    for layer in model.layers:
        name = type(layer).__name__
        tag = layer.saves or layer.uses
        names.append(name + (tag[len("skip") :] if tag else ""))
    return names

"""Two standard image classifiers built locally with random weights: VGG-16 and ResNet-50.

Lab 09's oracle describes them layer by layer; nothing is downloaded and they never
train here. The architectures are those of Simonyan & Zisserman, "Very Deep
Convolutional Networks for Large-Scale Image Recognition" (2015), configuration D,
and He, Zhang, Ren & Sun, "Deep Residual Learning for Image Recognition" (CVPR 2016),
the 50-layer network of bottleneck blocks (3, 4, 6, 3), with batch normalisation
after every convolution. Parameter counts match the published ones: 138,357,544 and
25,557,032 for 1000 classes. A downsampling block strides in its 3x3 convolution, as
torchvision's ResNet-50 does, not in its first 1x1 as the paper's: that 1x1 then runs at
the higher resolution, and a forward pass costs 4.1 G multiply-adds where He et al.
publish 3.8 G.
"""

from __future__ import annotations

import torch
from torch import nn

VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
RESNET50_BLOCKS = (3, 4, 6, 3)


def vgg16(classes: int = 1000) -> nn.Sequential:
    """VGG-16 (configuration D) for 224 x 224 images: 13 3x3 convolutions, 3 fully connected layers."""
    layers: list[nn.Module] = []
    cin = 3
    for item in VGG16:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, int(item), 3, padding=1), nn.ReLU()]
            cin = int(item)
    layers += [
        nn.AdaptiveAvgPool2d(7),
        nn.Flatten(),
        nn.Linear(512 * 7 * 7, 4096),
        nn.ReLU(),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Linear(4096, classes),
    ]
    return nn.Sequential(*layers)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (with the stride), 1x1 expand by 4, each with batch norm; plus the shortcut."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + self.shortcut(x))


def resnet50(classes: int = 1000) -> nn.Sequential:
    """ResNet-50: a 7x7 stem, 16 bottleneck blocks in four stages, global pooling, one linear layer."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for stage, blocks in enumerate(RESNET50_BLOCKS):
        width = 64 * 2**stage
        for block in range(blocks):
            layers.append(Bottleneck(cin, width, 2 if block == 0 and stage > 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)

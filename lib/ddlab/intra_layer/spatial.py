"""Spatial parallelism: every rank holds a slab of rows of every image and runs the whole network on it.

Only a k x k convolution (k > 1) needs rows it does not hold, and only k // 2 of them
on each side: the halo. Everything else the lab's UNet does stays inside the slab,
because the slab bounds are multiples of 2**depth (`slab_bounds`): 2x2 pooling and the
2x2 stride-2 transposed convolution map whole pairs of rows to rows, a skip has the
same slab as the decoder tensor it joins, and the 1x1 head reads one pixel.
(The UNet has no BatchNorm; with one, its batch statistics would be summed over the
slabs by an allreduce, like the gradients below.)

A convolution over the padded slab, cat([above, x, below]), is the simplest spatial
convolution, but the concatenation copies the slab, and autograd would keep the copy
beside x itself. `spatial_conv2d` instead convolves the slab with zero padding and
adds what the halo rows contribute to the first and last rows: the same sums, and
autograd keeps only x (shared with the previous ReLU) and the halo rows themselves.
Every rank holds all parameters; each one's gradient is a sum over the slabs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data_parallel import average_gradients
from ..models.unet import Conv, UNet
from ..runtime.comm import Comm
from ..runtime.counting import underlying
from .halo import HaloExchange
from .slabs import slab_bounds


def conv_halo(conv: nn.Conv2d) -> int:
    """Rows of halo a 'same' convolution needs on each side; ValueError for convolutions a slab cannot run."""
    kh, kw = conv.kernel_size
    same = conv.padding == (kh // 2, kw // 2) and conv.stride == (1, 1) and conv.dilation == (1, 1)
    if kh % 2 == 0 or kw % 2 == 0 or not same or conv.groups != 1:
        raise ValueError(
            f"spatial_conv2d runs odd k x k convolutions with stride 1 and 'same' padding (k // 2); "
            f"got kernel {conv.kernel_size}, padding {conv.padding}, stride {conv.stride}"
        )
    return kh // 2


def spatial_conv2d(x: torch.Tensor, conv: nn.Conv2d, comm: Comm, exchange: Any = HaloExchange) -> torch.Tensor:
    """conv applied to this rank's slab x (N, C, h, W) of an image split by rows over comm's ranks.

    Returns this rank's rows of conv's output. Two messages per neighbour (forward, backward).
    """
    p, pw = conv_halo(conv), int(conv.padding[1])
    out = F.conv2d(x, conv.weight, conv.bias, padding=(p, pw))  # the halo counted as zeros
    if p == 0:
        return out
    above, below = exchange.apply(x, comm, p)
    # Halo row j above reaches output row i through kernel row j - i (0 .. p-1); halo row j
    # below reaches output row h-p+m through kernel row 2p+j-m (p+1 .. 2p): two thin convolutions.
    top = F.conv2d(F.pad(above, (0, 0, 0, p - 1)), conv.weight[:, :, :p], padding=(0, pw))  # p rows
    bottom = F.conv2d(F.pad(below, (0, 0, p - 1, 0)), conv.weight[:, :, p + 1 :], padding=(0, pw))
    rest = out.shape[2] - p
    return out + F.pad(top, (0, 0, 0, rest)) + F.pad(bottom, (0, 0, rest, 0))


def padded_conv2d(x: torch.Tensor, conv: nn.Conv2d, comm: Comm, exchange: Any = HaloExchange) -> torch.Tensor:
    """The simplest spatial convolution: over cat([above, x, below]) (the copy autograd keeps too)."""
    p, pw = conv_halo(conv), int(conv.padding[1])
    if p == 0:
        return conv(x)
    above, below = exchange.apply(x, comm, p)
    return F.conv2d(torch.cat([above, x, below], dim=2), conv.weight, conv.bias, padding=(0, pw))


class SpatialUNet(nn.Module):
    """Rank r of comm runs a copy of `model` on rows bounds[r]:bounds[r+1] of images `height` rows high.

    The bounds are `slab_bounds(height, size, model.depth)` unless given.
    """

    def __init__(
        self, model: UNet, comm: Comm, height: int, exchange: Any = HaloExchange, bounds: list[int] | None = None
    ):
        super().__init__()
        self.model, self.comm, self.exchange = copy.deepcopy(model), comm, exchange
        self.bounds = slab_bounds(height, comm.Get_size(), model.depth) if bounds is None else list(bounds)
        self.height = height

    @property
    def rows(self) -> slice:
        rank = self.comm.Get_rank()
        return slice(self.bounds[rank], self.bounds[rank + 1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slab (N, C, rows, W) in, its rows of the class scores out."""
        skips: dict[str, torch.Tensor] = {}
        for layer in self.model.layers:
            if isinstance(layer, Conv):
                x = torch.relu(spatial_conv2d(x, layer.conv, self.comm, self.exchange))
            else:
                x = layer(x, skips)  # pooling, upsampling, concatenation, 1x1 head: inside the slab
        return x


def slab_loss(net: SpatialUNet, images: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """This rank's share of the mean cross-entropy, scaled by the slab count (so averaging gradients sums them)."""
    rows = net.rows
    logits = net(images[:, :, rows].clone())  # a copy: the rank keeps its slab, not the whole batch
    return nn.functional.cross_entropy(logits, masks[:, rows].clone(), reduction="sum") * (
        net.comm.Get_size() / masks.numel()
    )


def spatial_step(
    net: SpatialUNet,
    images: torch.Tensor,
    masks: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
    data_comm: Comm | None = None,
) -> float:
    """One step on the slabs of this batch: forward, backward, gradients summed over slabs (and averaged
    over `data_comm`, the ranks holding other samples, if any). Returns the batch's mean loss on every rank.

    images (N, C, H, W) and masks (N, H, W): the whole batch this rank's slab group trains on.
    """
    loss = slab_loss(net, images, masks)
    loss.backward()
    average_gradients(net.model, net.comm)  # mean of size x slab sums = sum over slabs
    total = underlying(net.comm).allreduce(loss.item()) / net.comm.Get_size()
    if data_comm is not None:
        average_gradients(net.model, data_comm)
        total = underlying(data_comm).allreduce(total) / data_comm.Get_size()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return total

"""Intra-layer parallelism equals one process: halo exchange, spatial, filter, channel, hybrid (float64, 1e-10).

Every rank runs the same tests on sub-communicators of 2 .. world-size ranks and
asserts on values gathered from all ranks, so a failure fails every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from ddlab.checks._core import each_size
from ddlab.data.images import make_segmentation
from ddlab.intra_layer import (
    ChannelParallelConv,
    FilterParallelConv,
    FilterUNet,
    HaloExchange,
    SpatialUNet,
    channel_slice,
    filter_slice,
    filter_step,
    hybrid_step,
    make_grid,
    padded_conv2d,
    slab_bounds,
    spatial_conv2d,
    spatial_step,
)
from ddlab.models.unet import Conv, UNet
from ddlab.runtime.blocks import block_range
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
SIZES = list(range(2, WORLD.Get_size() + 1))
TOL = 1e-10


def _each_sub(body) -> None:
    """body(sub) on the first P ranks for every P >= 2; its error must stay under TOL on every rank."""

    def problem(sub: MPI.Comm) -> str | None:
        error = body(sub)
        return f"largest error {error:.3g} (tolerance {TOL})" if error >= TOL else None

    each_size(WORLD, problem, "equality with one process", SIZES)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return float((a - b).abs().max()) if a.numel() else 0.0


def test_halo_exchange_brings_the_neighbours_rows_and_zeros_at_the_edges():
    def body(sub):
        x = torch.arange(2 * 3 * 11 * 5, dtype=torch.float64).reshape(2, 3, 11, 5)
        bounds, rank = slab_bounds(11, sub.Get_size()), sub.Get_rank()
        a, b = bounds[rank], bounds[rank + 1]
        above, below = HaloExchange.apply(x[:, :, a:b], sub, 1)
        want_above = x[:, :, a - 1 : a] if a > 0 else torch.zeros_like(above)
        want_below = x[:, :, b : b + 1] if b < 11 else torch.zeros_like(below)
        return max(_diff(above, want_above), _diff(below, want_below))

    _each_sub(body)


@pytest.mark.parametrize(
    "kernel, height, version", [(3, 11, "sum"), (5, 13, "sum"), (1, 9, "sum"), (3, 10, "padded"), (5, 12, "padded")]
)
def test_spatial_conv_equals_one_process(kernel, height, version):
    conv_fn = {"sum": spatial_conv2d, "padded": padded_conv2d}[version]

    def body(sub):
        torch.manual_seed(kernel)
        conv = torch.nn.Conv2d(3, 4, kernel, padding=kernel // 2).double()
        x = torch.randn(2, 3, height, 7, dtype=torch.float64, requires_grad=True)
        weights = torch.randn(2, 4, height, 7, dtype=torch.float64)
        (conv(x) * weights).sum().backward()
        want = [x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad.clone()]
        mine = copy.deepcopy(conv)
        mine.zero_grad()
        bounds, rank = slab_bounds(height, sub.Get_size()), sub.Get_rank()
        rows = slice(bounds[rank], bounds[rank + 1])
        slab = x.detach()[:, :, rows].clone().requires_grad_()
        out = conv_fn(slab, mine, sub)
        (out * weights[:, :, rows]).sum().backward()
        weight_grad = torch.from_numpy(sub.allreduce(mine.weight.grad.numpy()))
        bias_grad = torch.from_numpy(sub.allreduce(mine.bias.grad.numpy()))
        return max(
            _diff(out, conv(x)[:, :, rows]),
            _diff(slab.grad, want[0][:, :, rows]),
            _diff(weight_grad, want[1]),
            _diff(bias_grad, want[2]),
        )

    _each_sub(body)


def _unet_case(height: int, width: int = 24, batch: int = 2):
    torch.manual_seed(0)
    model = UNet(width=4, depth=3).double()
    images, masks = make_segmentation(batch, max(height, width), seed=3, dtype=torch.float64)
    images, masks = images[:, :, :height, :width].contiguous(), masks[:, :height, :width].contiguous()
    reference = copy.deepcopy(model)
    loss = F.cross_entropy(reference(images), masks)
    loss.backward()
    return model, images, masks, reference, loss.item()


def _grad_error(net: torch.nn.Module, reference: torch.nn.Module) -> float:
    return max(_diff(p.grad, q.grad) for p, q in zip(net.parameters(), reference.parameters()))


@pytest.mark.parametrize("height", [40, 64])
def test_spatial_unet_equals_one_process_with_uneven_slabs(height):
    model, images, masks, reference, want = _unet_case(height)

    def body(sub):
        net = SpatialUNet(model, sub, height)
        loss = spatial_step(net, images, masks)
        return max(abs(loss - want), _grad_error(net.model, reference))

    _each_sub(body)


def test_hybrid_data_by_spatial_equals_one_process_on_every_grid():
    model, images, masks, reference, want = _unet_case(32, batch=WORLD.Get_size() * 2 if WORLD.Get_size() < 4 else 4)
    size = WORLD.Get_size()
    for ways in [d for d in range(1, size + 1) if size % d == 0]:
        grid = make_grid(WORLD, ways)
        net = SpatialUNet(model, grid.spatial, 32)
        loss = hybrid_step(net, grid, images, masks)
        errors = WORLD.allgather(max(abs(loss - want), _grad_error(net.model, reference)))
        assert max(errors) < TOL, f"{ways} x {size // ways} grid: largest error per rank {errors}"
        assert (grid.spatial.Get_size(), grid.data.Get_size()) == (size // ways, ways)
        grid.free()


def _conv_reference(cin: int, cout: int, kernel: int):
    torch.manual_seed(cin + cout)
    conv = torch.nn.Conv2d(cin, cout, kernel, padding=kernel // 2).double()
    x = torch.randn(2, cin, 6, 5, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, cout, 6, 5, dtype=torch.float64)
    (conv(x) * weights).sum().backward()
    return conv, x, weights


@pytest.mark.parametrize("cout", [8, 5])
def test_filter_parallel_conv_equals_one_process(cout):
    conv, x, weights = _conv_reference(3, cout, 3)

    def body(sub):
        weight, bias = filter_slice(conv, sub)
        mine = block_range(cout, sub.Get_rank(), sub.Get_size())
        x_ = x.detach().clone().requires_grad_()
        out = FilterParallelConv.apply(x_, weight, bias, sub, conv.padding)
        (out * weights).sum().backward()
        return max(
            _diff(out, conv(x)),
            _diff(x_.grad, x.grad),
            _diff(weight.grad, conv.weight.grad[mine.start : mine.stop]),
            _diff(bias.grad, conv.bias.grad[mine.start : mine.stop]),
        )

    _each_sub(body)


def test_channel_parallel_conv_equals_one_process():
    conv, x, weights = _conv_reference(7, 4, 3)

    def body(sub):
        weight, cols = channel_slice(conv, sub)
        bias = torch.nn.Parameter(conv.bias.detach().clone())
        x_ = x.detach()[:, cols].clone().requires_grad_()
        out = ChannelParallelConv.apply(x_, weight, bias, sub, conv.padding)
        (out * weights).sum().backward()
        return max(
            _diff(out, conv(x)),
            _diff(x_.grad, x.grad[:, cols]),
            _diff(weight.grad, conv.weight.grad[:, cols]),
            _diff(bias.grad, conv.bias.grad),
        )

    _each_sub(body)


def test_filter_then_channel_parallel_keeps_the_slice_between_them():
    torch.manual_seed(5)
    first, second = torch.nn.Conv2d(3, 6, 3, padding=1).double(), torch.nn.Conv2d(6, 2, 3, padding=1).double()
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64, requires_grad=True)
    second(torch.relu(first(x))).square().sum().backward()

    def body(sub):
        w1, b1 = filter_slice(first, sub)
        w2, cols = channel_slice(second, sub)
        b2 = torch.nn.Parameter(second.bias.detach().clone())
        x_ = x.detach().clone().requires_grad_()
        hidden = torch.relu(FilterParallelConv.apply(x_, w1, b1, sub, 1))[:, cols]
        ChannelParallelConv.apply(hidden, w2, b2, sub, 1).square().sum().backward()
        rows = block_range(6, sub.Get_rank(), sub.Get_size())
        return max(
            _diff(x_.grad, x.grad),
            _diff(w1.grad, first.weight.grad[rows.start : rows.stop]),
            _diff(w2.grad, second.weight.grad[:, cols]),
            _diff(b2.grad, second.bias.grad),
        )

    _each_sub(body)


def test_filter_parallel_unet_equals_one_process():
    model, images, masks, reference, want = _unet_case(16, width=16)

    def body(sub):
        net = FilterUNet(model, sub)
        loss = filter_step(net, images, masks)
        errors = [abs(loss - want)]
        for layer, ref in zip(net.layers, reference.layers):
            if isinstance(ref, Conv):
                rows = block_range(ref.conv.out_channels, sub.Get_rank(), sub.Get_size())
                errors += [
                    _diff(layer.weight.grad, ref.conv.weight.grad[rows.start : rows.stop]),
                    _diff(layer.bias.grad, ref.conv.bias.grad[rows.start : rows.stop]),
                ]
            else:
                errors += [_diff(p.grad, q.grad) for p, q in zip(layer.parameters(), ref.parameters())]
        return max(errors)

    _each_sub(body)


def test_the_oracle_times_lab_08s_halo_exchange(comm):
    """Lab 09 prices the spatial strategy's halos with exchange_rows itself: it must run, on every size."""
    from ddlab.oracle.implementation import halo_curve

    sizes, seconds = halo_curve(comm, [64, 4096], gap=0.0)
    assert sizes == [64.0, 4096.0] and len(seconds) == 2 and all(0 <= s < 1 for s in seconds), seconds

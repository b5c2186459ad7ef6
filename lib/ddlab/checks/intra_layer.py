"""Checks for lab 08: the halo exchange, the filter-parallel convolution, slab bounds.

Each runs the student's piece on the first P ranks for every P (`each_size`), through
the counting communicator (`run_counted`), in float64, and compares with one process
to 1e-10: outputs, the input's gradient, the weights' gradients. The halo check also
counts messages: every rank sends its neighbours one message each way per direction
(forward rows, backward gradients), of halo x W x C x N x 8 bytes, and nothing else.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from ..data.images import make_segmentation
from ..intra_layer import SpatialUNet, filter_slice, padded_conv2d, spatial_step
from ..intra_layer.fit import COLLECTIVES
from ..models.unet import UNet
from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from ._core import count, each_size, is_integer, passed, run_counted

TOL = 1e-10
N, C, COUT, W = 2, 3, 5, 6


def _diff(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{what} is {type(got).__name__}, not a tensor"
    if got.shape != want.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"{what} has dtype {got.dtype}, expected {want.dtype}"
    error = float((got.detach() - want).abs().max()) if want.numel() else 0.0
    return None if error <= TOL else f"{what} differs from one process's by up to {error:.3g}"


def _grad(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None and t.grad is not None, "the reference's gradient is missing"
    return t.grad


def _reference(
    kernel: int, cout: int, height: int, seed: int, padding: int | None = None
) -> tuple[torch.nn.Conv2d, torch.Tensor, torch.Tensor]:
    """A float64 conv (padding kernel // 2 unless given), an input and output weights; gradients filled in."""
    torch.manual_seed(seed)
    pad = kernel // 2 if padding is None else padding
    conv = torch.nn.Conv2d(C, cout, kernel, padding=pad).double()
    x = torch.randn(N, C, height, W, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(N, cout, height + 2 * pad - kernel + 1, W + 2 * pad - kernel + 1, dtype=torch.float64)
    (conv(x) * weights).sum().backward()
    return conv, x, weights


# Exercise 8.1: the halo exchange --------------------------------------------------
# (kernel, image height): halos of 1 and 2 rows, uneven slabs. Height None: 3 rows per rank and one
# more, so on every size some slabs (3 rows) are thinner than their two 2-row halos together.
HALO_CASES: tuple[tuple[int, int | None], ...] = ((3, 10), (5, None))


class _Shaped:
    """fn, with a clear error when the halos it returns have the wrong shape."""

    def __init__(self, fn: Any):
        self.fn = fn

    def apply(self, x: torch.Tensor, comm: Comm, halo: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = self.fn.apply(x, comm, halo)
        want = (x.shape[0], x.shape[1], halo, x.shape[3])
        if not isinstance(got, tuple) or len(got) != 2:
            raise TypeError(f"apply(x, comm, halo) returned {type(got).__name__}; return two tensors (above, below)")
        for name, t in zip(("above", "below"), got):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"`{name}` has shape {shape}; a halo of {halo} rows of a slab {tuple(x.shape)} has shape {want}"
                )
        return got


def _halo_case(sub: MPI.Comm, fn: Any, kernel: int, height: int | None) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    height = 3 * size + 1 if height is None else height
    conv, x, weights = _reference(kernel, 4, height, seed=kernel)
    block = block_range(height, rank, size)
    rows = slice(block.start, block.stop)

    def run(counting: Any) -> tuple:
        mine = copy.deepcopy(conv)
        mine.zero_grad()
        slab = x.detach()[:, :, rows].clone().requires_grad_()
        out = padded_conv2d(slab, mine, counting, exchange=_Shaped(fn))
        (out * weights[:, :, rows]).sum().backward()
        return out.detach(), slab.grad, mine.weight.grad, None if mine.bias is None else mine.bias.grad

    where = f"{kernel}x{kernel} conv, image height {height}, rows {rows.start}-{rows.stop - 1} on this rank"
    (out, grad_x, grad_w, grad_b), traffic = run_counted(sub, run, (), f"HaloExchange ({where})")
    problems = [
        _diff(out, conv(x).detach()[:, :, rows], "the conv's output"),
        _diff(grad_x, _grad(x)[:, :, rows], "the slab's gradient (backward: did the halo's gradient go home?)"),
    ]
    if grad_w is not None and grad_b is not None:
        problems.append(
            _diff(
                torch.from_numpy(sub.allreduce(grad_w.numpy())),
                _grad(conv.weight),
                "the weight's gradient summed over ranks",
            )
        )
    problem = next((p for p in problems if p), None)
    if problem:
        return f"({where}) {problem}"
    halo = kernel // 2
    nbytes = halo * W * C * N * 8
    owed = Counter({(peer, nbytes): 2 for peer in (rank - 1, rank + 1) if 0 <= peer < size})
    sent = Counter((e.peer, e.nbytes) for e in traffic[rank].sends if e.peer != MPI.PROC_NULL)
    if sent != owed:

        def describe(c: Counter) -> str:
            return ", ".join(f"{n} x {b} B to rank {p}" for (p, b), n in sorted(c.items())) or "nothing"

        if sent and all(2 * n == owed[key] for key, n in sent.items()) and sent.keys() == owed.keys():
            return (
                f"({where}) sent {describe(sent)} through the communicator passed to apply, half of "
                f"{describe(owed)}: one direction's halos went another way. Does backward use the notebook's "
                "`comm` (MPI.COMM_WORLD) instead of the one forward was given? Keep forward's `comm` in ctx "
                "and send on it: on a sub-communicator a global one waits for ranks that are not there"
            )
        return (
            f"({where}) sent {describe(sent)}; a halo of {halo} rows x {W} columns x {C} channels x {N} "
            f"images x 8 B is {nbytes} B, one to each neighbour forward and one backward: {describe(owed)}"
        )
    return None


def check_halo_exchange(fn: Any) -> None:
    """fn: an autograd Function like ddlab.intra_layer.HaloExchange: apply(x, comm, halo) -> (above, below)."""
    world = MPI.COMM_WORLD
    # The whole world first: an exchange that sends on a global communicator instead of the one
    # passed in still completes there (its neighbours are the same), and the counts show it; on a
    # smaller sub-communicator the same answer would wait for ranks outside it forever.
    sizes = range(world.Get_size(), 0, -1)
    for case in HALO_CASES:
        each_size(
            world,
            functools.partial(_halo_case, fn=fn, kernel=case[0], height=case[1]),
            "HaloExchange does not make a slab's convolution equal one process's",
            sizes,
        )
    passed(
        world,
        "HaloExchange: every slab's conv output and gradients equal one process's; "
        "one halo message to each neighbour per direction, of the halo's bytes",
    )


# Exercise 8.2: the filter-parallel convolution ------------------------------------
def _filter_case(sub: MPI.Comm, fn: Any, padding: int) -> str | None:
    conv, x, weights = _reference(3, COUT, 7, seed=2, padding=padding)
    mine = block_range(COUT, sub.Get_rank(), sub.Get_size())

    def run(counting: Any) -> tuple:
        weight, bias = filter_slice(conv, counting)
        x_ = x.detach().clone().requires_grad_()
        out = fn.apply(x_, weight, bias, counting, padding)
        (out * weights).sum().backward()
        return out, x_.grad, weight.grad, None if bias is None else bias.grad

    where = (
        f"{COUT} output channels over {sub.Get_size()} ranks, this rank's {mine.start}-{mine.stop - 1}, "
        f"padding {padding}"
    )
    out, grad_x, grad_w, grad_b = run_counted(sub, run, (), f"FilterParallelConv ({where})", allow=COLLECTIVES)[0]
    if grad_w is None or grad_b is None:
        return f"({where}) the gradient of this rank's weight or bias is missing: backward must return them"
    problems = [
        _diff(out, conv(x).detach(), "the output (all channels, on every rank)"),
        _diff(grad_x, _grad(x), "the input's gradient (the sum over every rank's channels)"),
        _diff(grad_w, _grad(conv.weight)[mine.start : mine.stop], "this rank's weight gradient"),
        _diff(grad_b, _grad(conv.bias)[mine.start : mine.stop], "this rank's bias gradient"),
    ]
    problem = next((p for p in problems if p), None)
    return f"({where}) {problem}" if problem else None


def check_filter_parallel_conv(fn: Any) -> None:
    """fn: an autograd Function like ddlab.intra_layer.FilterParallelConv: apply(x, weight, bias, comm, padding)."""
    world = MPI.COMM_WORLD
    for padding in (1, 0, 2):  # the argument the signature names: 1 keeps the size, 0 shrinks it, 2 grows it
        each_size(
            world,
            functools.partial(_filter_case, fn=fn, padding=padding),
            "FilterParallelConv does not equal one process's convolution",
        )
    passed(
        world,
        "FilterParallelConv: the whole output on every rank, the input's and this rank's weight "
        "gradients equal one process's",
    )


# Exercise 8.3: slab bounds -------------------------------------------------------
SLAB_CASES = ((48, 3), (40, 3), (112, 3), (24, 1), (13, 0), (96, 2), (64, 4))  # (height, levels)


def _bounds_problem(fn: Callable[..., Any], height: int, size: int, levels: int) -> str | None:
    unit = 2**levels
    case = f"slab_bounds({height}, {size}, {levels})"
    if height // unit < size:
        try:
            got = fn(height, size, levels)
        except ValueError:
            return None
        return f"{case} returned {got!r}; {height // unit} blocks of {unit} rows cannot give {size} ranks one each: raise ValueError"
    got = fn(height, size, levels)
    if not isinstance(got, (list, tuple, np.ndarray)) or len(got) != size + 1 or not all(is_integer(b) for b in got):
        return f"{case} returned {got!r}; return a list of size + 1 = {size + 1} ints"
    got = [int(b) for b in got]
    if got[0] != 0 or got[-1] != height or any(a >= b for a, b in zip(got, got[1:])):
        return f"{case} returned {got}: bounds must increase strictly from 0 to {height}"
    broken = [b for b in got if b % unit]
    if broken:
        level = min(n for n in range(levels + 1) if broken[0] % 2**n)
        return (
            f"{case} returned {got}: bound {broken[0]} is not a multiple of 2**levels = {unit}, so after "
            f"{count(level, 'halving')} it falls between two rows"
        )
    rows = [b - a for a, b in zip(got, got[1:])]
    if max(rows) - min(rows) > unit:
        return f"{case} returned {got}: slabs of {rows} rows; they can be more even (differ by at most {unit} rows)"
    return None


def _slab_case(sub: MPI.Comm, fn: Callable[..., Any]) -> str | None:
    size = sub.Get_size()
    too_few = ((8 * (size - 1), 3),) if size > 1 else ()  # one block of 8 rows per rank, one short
    for height, levels in SLAB_CASES + too_few:
        try:
            problem = _bounds_problem(fn, height, size, levels)
        except NotImplementedError:
            raise
        except Exception as err:  # the same on every rank: fn sees the same arguments
            problem = f"slab_bounds({height}, {size}, {levels}) raised {type(err).__name__}: {err}"
        if problem:
            return problem
    torch.manual_seed(0)
    model = UNet(width=2, depth=2).double()
    height = 4 * (size + 1)  # uneven slabs whenever size > 1
    images, masks = make_segmentation(2, height, seed=1, dtype=torch.float64)
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(images), masks).backward()
    net = SpatialUNet(model, sub, height, bounds=fn(height, size, 2))
    spatial_step(net, images, masks)
    error = max(
        float((_grad(p) - _grad(q)).abs().max()) for p, q in zip(net.model.parameters(), reference.parameters())
    )
    if error > TOL:
        return f"a UNet of depth 2 on slabs {net.bounds} of height {height} gets gradients off by {error:.3g}"
    return None


def check_slab_bounds(fn: Callable[[int, int, int], list[int]]) -> None:
    """fn(height, size, levels) -> bounds, like ddlab.intra_layer.slab_bounds."""
    world = MPI.COMM_WORLD
    each_size(world, lambda sub: _slab_case(sub, fn), "slab_bounds is wrong")
    passed(
        world,
        "slab_bounds: slabs whole at every pooling level, as even as possible; the spatial UNet "
        "trains on them like one process",
    )

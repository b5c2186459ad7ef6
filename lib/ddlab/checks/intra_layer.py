"""Checks for lab 08: the halo exchange, the filter-parallel convolution, slab bounds, the spatial max pooling.

Each runs the student's piece on the first P ranks for every P (`each_size`), through
the counting communicator (`run_counted`), and compares with one process: outputs, the
input's gradient, the weights' gradients, to 1e-10 in float64 (1e-4 in float32, whose sums
round). The halo check also counts messages: every rank sends its neighbours one message
each way per direction (forward rows, backward gradients), of halo x W x C x N x itemsize
bytes, and nothing else; it runs in float32 too, so a receive buffer made in float64 fails.
The pooling check runs float64 and float32, heights that are not a multiple of the stride,
uneven slabs, and counts the unequal halos' messages; its input must come back unchanged.

Under the grader's draw (`ddlab.checks._draw`, `ddlab grade --seed S`) every check runs drawn
ranks in a drawn order instead of the first P, and drawn cases within what the lab's text promises:
images of drawn batch, channels, height and width, kernels, paddings, strides, channel counts and
data; each check's docstring says what it draws. A failure names the drawn case and the seed.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from ..data.images import make_segmentation
from ..intra_layer import SpatialUNet, filter_slice, padded_conv2d, spatial_step
from ..intra_layer.fit import COLLECTIVES
from ..models.unet import UNet
from ..runtime.blocks import block_bounds, block_range
from ..runtime.comm import Comm
from ._core import count, each_size, fail_together, is_integer, passed, run_counted
from ._draw import Draw, grading_draw, named

TOL = 1e-10
TOLERANCES = {torch.float64: TOL, torch.float32: 1e-4}  # float32 sums round differently in another order
#: Seconds a rank may stall inside the student's exchange before the check calls it a deadlock.
TIMEOUT = 20.0
N, C, COUT, W = 2, 3, 5, 6
DTYPE_HINT = "was a receive buffer made in another dtype than the slab's (torch.empty's default is float32)?"


def _diff(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{what} is {type(got).__name__}, not a tensor"
    if got.shape != want.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"{what} has dtype {got.dtype}, expected {want.dtype}: {DTYPE_HINT}"
    error = float((got.detach() - want).abs().max()) if want.numel() else 0.0
    return None if error <= TOLERANCES[want.dtype] else f"{what} differs from one process's by up to {error:.3g}"


def _describe(sent: Counter) -> str:
    """'2 x 144 B to rank 1, ...': a rank's messages, by peer and size."""
    return ", ".join(f"{n} x {b} B to rank {p}" for (p, b), n in sorted(sent.items())) or "nothing"


def _object_api_hint(sent: Counter, owed: Counter) -> str:
    """The likely cause when the right ranks got the messages but some carried a size no halo has: pickled objects."""
    peers = sorted(peer for peer, _ in sent.elements()) == sorted(peer for peer, _ in owed.elements())
    more = sum(b * n for (_, b), n in sent.items()) > sum(b * n for (_, b), n in owed.items())
    odd = [b for _, b in sent - owed if not any(b % halo == 0 for _, halo in owed if halo)]  # not whole halos
    if not (peers and more and odd):
        return ""
    return (
        ". Right messages, more bytes: is it the pickled object API? Lower-case sendrecv/send pickle the tensor; "
        "the lab asks for the buffer API (Sendrecv, Isend/Irecv on NumPy arrays), whose messages carry the rows only"
    )


def _grad(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None and t.grad is not None, "the reference's gradient is missing"
    return t.grad


@dataclass(frozen=True)
class Images:
    """A case's images: batch n, channels c, width w (the height is the case's own); the notebook's by default."""

    n: int = N
    c: int = C
    w: int = W

    def __str__(self) -> str:
        return f"batch {self.n}, {self.c} channels, width {self.w}"


def _drawn_images(draw: Draw, *keys: object) -> Images:
    """Small images of a drawn batch (1-3), channel count (1-4) and width (1-9)."""
    return Images(draw.integer(1, 3, "n", *keys), draw.integer(1, 4, "c", *keys), draw.integer(1, 9, "w", *keys))


#: The dtypes the lab's checks run (and the grader draws): the tolerances are theirs.
FLOATS = (torch.float64, torch.float32)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _reference(
    kernel: int,
    cout: int,
    height: int,
    seed: int,
    padding: int | None = None,
    dtype: torch.dtype = torch.float64,
    images: Images = Images(),
) -> tuple[torch.nn.Conv2d, torch.Tensor, torch.Tensor]:
    """A conv (padding kernel // 2 unless given), an input and output weights; gradients filled in."""
    torch.manual_seed(seed)
    pad = kernel // 2 if padding is None else padding
    n, c, w = images.n, images.c, images.w
    conv = torch.nn.Conv2d(c, cout, kernel, padding=pad).to(dtype)
    x = torch.randn(n, c, height, w, dtype=dtype, requires_grad=True)
    weights = torch.randn(n, cout, height + 2 * pad - kernel + 1, w + 2 * pad - kernel + 1, dtype=dtype)
    (conv(x) * weights).sum().backward()
    return conv, x, weights


# Exercise 8.1: the halo exchange --------------------------------------------------
@dataclass(frozen=True)
class HaloCase:
    """A case of the halo check: kernel, image height (None: 3 rows per rank and one more), dtype, the images,
    the data's seed (None: the kernel); under the grader's draw, the height is drawn per size (`_halo_height`)."""

    kernel: int
    height: int | None
    dtype: torch.dtype
    images: Images = Images()
    seed: int | None = None
    draw: Draw | None = None


# Halos of 1 and 2 rows, uneven slabs. Height None: 3 rows per rank and one more, so on every size some slabs
# (3 rows) are thinner than their two 2-row halos together. Both dtypes: a receive buffer made in float64
# fails the float32 case, one in float32 the float64 case.
HALO_CASES = (HaloCase(3, 10, torch.float64), HaloCase(5, None, torch.float32))


def _elsewhere(sent: Counter, owed: Counter) -> str:
    """What the halo check says when half of a rank's messages did not go through the communicator it gave."""
    return (
        f"sent {_describe(sent)} through the communicator passed to apply, half of {_describe(owed)}: one "
        "direction's halos went another way. Does backward use the notebook's `comm` (MPI.COMM_WORLD) instead "
        "of the one forward was given? Keep forward's `comm` in ctx and send on it: on a sub-communicator a "
        "global one waits for ranks that are not there"
    )


#: The kernels the grader draws (halos of 1 to 3 rows).
DRAWN_KERNELS = (3, 5, 7)


def _halo_cases(draw: Draw | None) -> tuple[HaloCase, ...]:
    """The notebook's cases, or the grader's: one per dtype, of a drawn kernel, images and data."""
    if draw is None:
        return HALO_CASES
    return tuple(
        HaloCase(
            draw.choose(DRAWN_KERNELS, 1, "kernel", i)[0],
            None,
            dtype,
            _drawn_images(draw, "halo", i),
            draw.data_seed("halo", i),
            draw,
        )
        for i, dtype in enumerate(FLOATS)
    )


def _halo_height(case: HaloCase, size: int) -> int:
    """The image's height on `size` ranks; drawn: every slab at least a halo tall (the exercise's h >= halo)."""
    if case.draw is None:
        return 3 * size + 1 if case.height is None else case.height
    halo = case.kernel // 2
    return halo * size + case.draw.integer(0, 2 * size + 1, "rows", case.kernel, _dtype_name(case.dtype), size)


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
            if t.dtype != x.dtype:
                raise TypeError(f"`{name}` has dtype {t.dtype}, the slab's is {x.dtype}: {DTYPE_HINT}")
        return got


def _halo_case(sub: MPI.Comm, fn: Any, case: HaloCase, timeout: float = TIMEOUT) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    kernel, dtype, images = case.kernel, case.dtype, case.images
    height = _halo_height(case, size)
    conv, x, weights = _reference(kernel, 4, height, kernel if case.seed is None else case.seed, None, dtype, images)
    block = block_range(height, rank, size)
    rows = slice(block.start, block.stop)

    def run(counting: Any) -> tuple:
        mine = copy.deepcopy(conv)
        mine.zero_grad()
        slab = x.detach()[:, :, rows].clone().requires_grad_()
        out = padded_conv2d(slab, mine, counting, exchange=_Shaped(fn))
        (out * weights[:, :, rows]).sum().backward()
        return out.detach(), slab.grad, mine.weight.grad, None if mine.bias is None else mine.bias.grad

    where = (
        f"{kernel}x{kernel} conv, image height {height}, rows {rows.start}-{rows.stop - 1} on this rank, "
        f"{_dtype_name(dtype)}"
    )
    if case.draw is not None:
        where += f", {images}, data seed {case.seed}{named(case.draw)}"
    (out, grad_x, grad_w, grad_b), traffic = run_counted(sub, run, (), f"HaloExchange ({where})", timeout)
    problems = [
        _diff(out, conv(x).detach()[:, :, rows], "the conv's output"),
        _diff(grad_x, _grad(x)[:, :, rows], "the slab's gradient (backward: did the halo's gradient go home?)"),
    ]
    if grad_w is not None and grad_b is not None:
        problems.append(
            _diff(
                torch.from_numpy(sub.allreduce(grad_w.numpy())).to(dtype),
                _grad(conv.weight),
                "the weight's gradient summed over ranks",
            )
        )
    problem = next((p for p in problems if p), None)
    halo, itemsize = kernel // 2, x.element_size()
    nbytes = halo * images.w * images.c * images.n * itemsize
    owed = Counter({(peer, nbytes): 2 for peer in (rank - 1, rank + 1) if 0 <= peer < size})
    sent = Counter((e.peer, e.nbytes) for e in traffic[rank].sends if e.peer != MPI.PROC_NULL)
    half = bool(sent) and sent.keys() == owed.keys() and all(2 * n == owed[key] for key, n in sent.items())
    if problem:  # a global communicator in backward sends to the world's neighbours: on drawn ranks, other ones
        return f"({where}) {problem}" + (f". It {_elsewhere(sent, owed)}" if half else "")
    if sent != owed:
        if half:
            return f"({where}) {_elsewhere(sent, owed)}"
        return (
            f"({where}) sent {_describe(sent)}; a halo of {halo} rows x {images.w} columns x {images.c} channels x "
            f"{images.n} images x {itemsize} B is {nbytes} B, one to each neighbour forward and one backward: "
            f"{_describe(owed)}{_object_api_hint(sent, owed)}"
        )
    return None


def check_halo_exchange(fn: Any, timeout: float = TIMEOUT) -> None:
    """fn: an autograd Function like ddlab.intra_layer.HaloExchange: apply(x, comm, halo) -> (above, below).

    A rank stalled `timeout` seconds inside fn fails the check (a deadlock, or a message never sent).

    The grader's draw: the ranks (all of them first, then 3, 2, 1, each set in a drawn order) and, for
    float64 and float32 each, a kernel of 3, 5 or 7 (halos of 1 to 3 rows), images of batch 1-3, 1-4
    channels, width 1-9 and a height of at least a halo per rank (uneven slabs as they fall), and their data.
    """
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "halo_exchange")
    # The whole world first: an exchange that sends on a global communicator instead of the one
    # passed in still completes there (its neighbours are the same), and the counts show it; on a
    # smaller sub-communicator the same answer would wait for ranks outside it forever.
    sizes = range(world.Get_size(), 0, -1)
    cases = _halo_cases(draw)
    for case in cases:
        each_size(
            world,
            functools.partial(_halo_case, fn=fn, case=case, timeout=timeout),
            "HaloExchange does not make a slab's convolution equal one process's",
            sizes,
            draw=draw,
        )
    scope = (
        "float64 and float32"
        if draw is None
        else ", ".join(f"{c.kernel}x{c.kernel} {_dtype_name(c.dtype)}" for c in cases)
    )
    passed(
        world,
        f"HaloExchange: every slab's conv output and gradients equal one process's ({scope}); "
        f"one halo message to each neighbour per direction, of the halo's bytes{named(draw)}",
    )


# Exercise 8.2: the filter-parallel convolution ------------------------------------
@dataclass(frozen=True)
class FilterCase:
    """A case of the filter check: padding, dtype, kernel, image height, the images, the data's seed; under
    the grader's draw, the output channels are drawn per size (`_filter_channels`), else COUT."""

    padding: int
    dtype: torch.dtype
    kernel: int = 3
    height: int = 7
    images: Images = Images()
    seed: int = 2
    draw: Draw | None = None


#: The padding the signature names (1 keeps the size, 0 shrinks it, 2 grows it), and float32 too, so an output
#: or gradient made in a fixed dtype fails one of them.
FILTER_CASES = tuple(
    FilterCase(padding, dtype)
    for padding, dtype in ((1, torch.float64), (0, torch.float64), (2, torch.float64), (1, torch.float32))
)
#: The strategies' collectives, and the object forms for small values (the channel counts), as the text says.
ALLOWED = (*COLLECTIVES, "allgather", "allreduce")


def _filter_cases(draw: Draw | None) -> tuple[FilterCase, ...]:
    """The notebook's cases, or the grader's four: float64, float32 and two drawn, each of a drawn kernel (1, 3
    or 5), padding (0 to the kernel), height and width (5-9), batch (1-3), input channels (1-4) and data."""
    if draw is None:
        return FILTER_CASES
    dtypes = (torch.float64, torch.float32, *(draw.choose(FLOATS, 1, "dtype", i)[0] for i in (2, 3)))
    cases = []
    for i, dtype in enumerate(dtypes):
        kernel = draw.choose((1, 3, 5), 1, "filter kernel", i)[0]
        images = Images(draw.integer(1, 3, "n", i), draw.integer(1, 4, "cin", i), draw.integer(5, 9, "w", i))
        cases.append(
            FilterCase(
                draw.integer(0, kernel, "padding", i),
                dtype,
                kernel,
                draw.integer(5, 9, "height", i),
                images,
                draw.data_seed("filter", i),
                draw,
            )
        )
    return tuple(cases)


def _filter_channels(case: FilterCase, size: int) -> int:
    """The output channels on `size` ranks: COUT, or drawn from size to 2 size + 3 (at least one per rank)."""
    if case.draw is None:
        return COUT
    return case.draw.integer(size, 2 * size + 3, "cout", case.seed, size)


def _filter_case(sub: MPI.Comm, fn: Any, case: FilterCase) -> str | None:
    padding, dtype, cout = case.padding, case.dtype, _filter_channels(case, sub.Get_size())
    conv, x, weights = _reference(case.kernel, cout, case.height, case.seed, padding, dtype, case.images)
    mine = block_range(cout, sub.Get_rank(), sub.Get_size())

    def run(counting: Any) -> tuple:
        weight, bias = filter_slice(conv, counting)
        x_ = x.detach().clone().requires_grad_()
        out = fn.apply(x_, weight, bias, counting, padding)
        (out * weights).sum().backward()
        return out, x_.grad, weight.grad, None if bias is None else bias.grad

    where = (
        f"{cout} output channels over {sub.Get_size()} ranks, this rank's {mine.start}-{mine.stop - 1}, "
        f"padding {padding}, {_dtype_name(dtype)}"
    )
    if case.draw is not None:
        where += (
            f", {case.kernel}x{case.kernel} kernel, images of height {case.height}, {case.images}, "
            f"data seed {case.seed}{named(case.draw)}"
        )
    out, grad_x, grad_w, grad_b = run_counted(sub, run, (), f"FilterParallelConv ({where})", allow=ALLOWED)[0]
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
    """fn: an autograd Function like ddlab.intra_layer.FilterParallelConv: apply(x, weight, bias, comm, padding).

    The grader's draw: the ranks (each set in a drawn order), and four cases (float64, float32 and two
    drawn of them) of a drawn kernel (1, 3 or 5), padding (0 to the kernel), image height and width (5-9),
    batch (1-3), input channels (1-4), output channels (P to 2P + 3: every rank one or more) and data.
    """
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "filter_parallel_conv")
    for case in _filter_cases(draw):
        each_size(
            world,
            functools.partial(_filter_case, fn=fn, case=case),
            "FilterParallelConv does not equal one process's convolution",
            draw=draw,
        )
    passed(
        world,
        "FilterParallelConv: the whole output on every rank, the input's and this rank's weight "
        f"gradients equal one process's{named(draw)}",
    )


# Exercise 8.3: slab bounds -------------------------------------------------------
# (height, levels); 50 and 38 are no multiple of 8 or 4 (enough blocks for 4 ranks): no bounds can keep whole rows.
SLAB_CASES = ((48, 3), (40, 3), (112, 3), (24, 1), (13, 0), (96, 2), (64, 4), (50, 3), (38, 2))


def _bounds_problem(fn: Callable[..., Any], height: int, size: int, levels: int) -> str | None:
    unit = 2**levels
    case = f"slab_bounds({height}, {size}, {levels})"
    if height % unit or height // unit < size:
        try:
            got = fn(height, size, levels)
        except ValueError:
            return None
        why = (
            f"{height} rows are not a multiple of 2**levels = {unit}, so {count(levels, 'halving')} cannot keep "
            "every slab whole rows"
            if height % unit
            else f"{height // unit} blocks of {unit} rows cannot give {size} ranks one each"
        )
        return (
            f"{case} returned {got!r}; {why}: raise ValueError (valid heights are multiples of {unit} "
            f"with at least size = {size} blocks of {unit} rows)"
        )
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


def _slab_table(size: int, draw: Draw | None) -> list[tuple[int, int, int]]:
    """(height, size, levels) cases for bounds on `size` ranks: the notebook's (and one block too few), or nine
    drawn: levels 0-4 and sizes 1-12 each, three of valid heights (size to 4 size + 3 blocks), three of
    heights no multiple of 2**levels (valid ones where levels is 0), three of fewer blocks than ranks."""
    if draw is None:
        too_few = [(8 * (size - 1), size, 3)] if size > 1 else []  # one block of 8 rows per rank, one short
        return [(height, size, levels) for height, levels in SLAB_CASES] + too_few
    cases = []
    for i in range(9):
        levels, ranks = draw.integer(0, 4, "levels", size, i), draw.integer(1, 12, "size", size, i)
        unit = 2**levels
        if i % 3 == 2:  # too few blocks: one to ranks - 1 of them (two ranks at least)
            ranks = max(ranks, 2)
            cases.append((unit * draw.integer(1, ranks - 1, "blocks", size, i), ranks, levels))
            continue
        height = unit * draw.integer(ranks, 4 * ranks + 3, "blocks", size, i)
        if i % 3 == 1 and unit > 1:  # a height that is no multiple of 2**levels
            height += draw.integer(1, unit - 1, "rest", size, i)
        cases.append((height, ranks, levels))
    return cases


def _slab_case(sub: MPI.Comm, fn: Callable[..., Any], draw: Draw | None = None) -> str | None:
    size = sub.Get_size()
    for height, ranks, levels in _slab_table(size, draw):
        try:
            problem = _bounds_problem(fn, height, ranks, levels)
        except NotImplementedError:
            raise
        except Exception as err:  # the same on every rank: fn sees the same arguments
            problem = f"slab_bounds({height}, {ranks}, {levels}) raised {type(err).__name__}: {err}"
        if problem:
            return problem + named(draw)
    model_seed, data_seed = (0, 1) if draw is None else (draw.data_seed("model", size), draw.data_seed("data", size))
    torch.manual_seed(model_seed)
    model = UNet(width=2, depth=2).double()
    # uneven slabs whenever size > 1 (the notebook's); drawn: size to 2 size + 1 blocks of 4 rows
    height = 4 * (size + 1) if draw is None else 4 * draw.integer(size, 2 * size + 1, "unet", size)
    images, masks = make_segmentation(2, height, seed=data_seed, dtype=torch.float64)
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(images), masks).backward()
    net = SpatialUNet(model, sub, height, bounds=fn(height, size, 2))
    spatial_step(net, images, masks)
    error = max(
        float((_grad(p) - _grad(q)).abs().max()) for p, q in zip(net.model.parameters(), reference.parameters())
    )
    if error > TOL:
        seeds = "" if draw is None else f" (model seed {model_seed}, images of seed {data_seed}{named(draw)})"
        return f"a UNet of depth 2 on slabs {net.bounds} of height {height}{seeds} gets gradients off by {error:.3g}"
    return None


def check_slab_bounds(fn: Callable[[int, int, int], list[int]]) -> None:
    """fn(height, size, levels) -> bounds, like ddlab.intra_layer.slab_bounds.

    The grader's draw: the ranks (each set in a drawn order); per size nine drawn (height, size, levels)
    cases, levels 0-4 and sizes 1-12, three valid, three of heights no multiple of 2**levels, three of
    fewer blocks than ranks; then the UNet's height (P to 2P + 1 blocks of 4 rows), weights and images.
    """
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "slab_bounds")
    each_size(world, lambda sub: _slab_case(sub, fn, draw), "slab_bounds is wrong", draw=draw)
    passed(
        world,
        "slab_bounds: slabs whole at every pooling level, as even as possible; the spatial UNet "
        f"trains on them like one process{named(draw)}",
    )


# Exercise 8.4: the spatial max pooling ---------------------------------------------
@dataclass(frozen=True)
class PoolCase:
    """A case of the pooling check: kernel, stride, dtype, the images (width POOL_WIDTH unless drawn), the data's
    seed (None: kernel * 10 + stride); under the grader's draw, the height is drawn per size (`_pool_height`)."""

    kernel: int
    stride: int
    dtype: torch.dtype
    images: Images | None = None
    seed: int | None = None
    draw: Draw | None = None


# ResNet's stem pool (halos of 1 row above, none below), a 5x5 window with stride 2 (2 above, 1 below) and a
# 3x3 with stride 1 (1 and 1); float64 and float32 (a receive buffer made in the other dtype fails one of them).
POOL_CASES = (PoolCase(3, 2, torch.float64), PoolCase(5, 2, torch.float32), PoolCase(3, 1, torch.float64))
POOL_WIDTH = 7  # odd: the columns' -inf padding matters at both sides


def _pool_cases(draw: Draw | None) -> tuple[PoolCase, ...]:
    """The notebook's cases, or the grader's three (float64, float32 and one drawn), each of a drawn kernel (3, 5
    or 7), stride (1 to 3: a window may reach no row below its slab, or skip rows), images and data."""
    if draw is None:
        return POOL_CASES
    dtypes = (*FLOATS, draw.choose(FLOATS, 1, "pool dtype")[0])
    return tuple(
        PoolCase(
            draw.choose(DRAWN_KERNELS, 1, "pool kernel", i)[0],
            draw.integer(1, 3, "stride", i),
            dtype,
            _drawn_images(draw, "pool", i),
            draw.data_seed("pool", i),
            draw,
        )
        for i, dtype in enumerate(dtypes)
    )


def _pool_height(case: PoolCase, size: int) -> int:
    """The image's height on `size` ranks: the notebook's, or drawn so that every slab is at least as tall as
    the halos it lends (blocks of stride rows, at least ceil(p / stride) + 1 a rank), the last block short or not."""
    stride = case.stride
    if case.draw is None:
        return stride * (2 * size + 1) + 1  # not a multiple of the stride (if > 1); uneven slabs on 3 and 4 ranks
    least = -(-(case.kernel // 2) // stride) + 1
    keys = (case.kernel, stride, _dtype_name(case.dtype), size)
    blocks = size * least + case.draw.integer(0, size, "blocks", *keys)
    return stride * blocks - case.draw.integer(0, stride - 1, "short", *keys)


def pool_bounds(height: int, size: int, stride: int) -> list[int]:
    """Row bounds of the check's slabs: blocks of `stride` rows dealt out in rank order, the last one short."""
    blocks = -(-height // stride)
    return [min(height, stride * b) for b in block_bounds(blocks, size)]


def _pool_messages(rank: int, size: int, kernel: int, stride: int, row_bytes: int) -> Counter:
    """The (peer, bytes) of what this rank owes: forward rows, backward the halos' gradients."""
    p, q = kernel // 2, max(0, kernel // 2 + 1 - stride)
    owed: Counter = Counter()
    for peer, rows in ((rank + 1, p), (rank - 1, q), (rank - 1, p), (rank + 1, q)):  # forward two, backward two
        if 0 <= peer < size and rows:
            owed[(peer, rows * row_bytes)] += 1
    return owed


def _pool_traffic_problem(sent: Counter, owed: Counter, p: int, q: int, stride: int, row_bytes: int) -> str:
    text = (
        f"sent {_describe(sent)}; owed {_describe(owed)}: forward the slab's last {p} rows to rank+1 and "
        f"its first {q} rows to rank-1, backward their gradients home ({p} to rank-1, {q} to rank+1), "
        f"{row_bytes} B a row, no message of zero rows"
    )
    if any(b == 0 for _, b in sent):
        return text + ": a side that needs no rows gets no message"
    pickled = _object_api_hint(sent, owed)
    if pickled:
        return text + pickled
    if sum(b * n for (_, b), n in sent.items()) > sum(b * n for (_, b), n in owed.items()):
        return text + (
            f". That is more bytes than the windows read: does every halo send kernel // 2 rows both ways, "
            f"as a convolution's does? With stride {stride}, a slab's windows read {q} rows below it"
        )
    return text


def _pool_case(sub: MPI.Comm, fn: Any, case: PoolCase, timeout: float) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    kernel, stride, dtype = case.kernel, case.stride, case.dtype
    images = Images(N, C, POOL_WIDTH) if case.images is None else case.images
    height = _pool_height(case, size)
    bounds = pool_bounds(height, size, stride)
    rows, outs = (
        slice(bounds[rank], bounds[rank + 1]),
        slice(-(-bounds[rank] // stride), -(-bounds[rank + 1] // stride)),
    )
    torch.manual_seed(kernel * 10 + stride if case.seed is None else case.seed)
    image = torch.randn(images.n, images.c, height, images.w, dtype=dtype) - 2  # mostly negative: -inf, not 0
    image.requires_grad_()
    whole = F.max_pool2d(image, kernel, stride, kernel // 2)
    weights = torch.randn(whole.shape, dtype=dtype)
    (whole * weights).sum().backward()
    want = whole.detach()[:, :, outs]
    slab = image.detach()[:, :, rows].clone().requires_grad_()
    before = slab.detach().clone()

    def run(counting: Any) -> tuple:
        y = fn.apply(slab, counting, kernel, stride)
        if not isinstance(y, torch.Tensor) or y.shape != want.shape:
            shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(
                f"the output has shape {shape}, expected {tuple(want.shape)}: this rank's output rows are those "
                f"whose window centre (row i * stride) lies in its slab, rows {outs.start}-{outs.stop - 1}"
            )
        (y * weights[:, :, outs]).sum().backward()
        return y.detach(), slab.grad

    where = (
        f"{kernel}x{kernel} max pooling, stride {stride}, image height {height}, rows {rows.start}-{rows.stop - 1} "
        f"on this rank, {_dtype_name(dtype)}"
    )
    if case.draw is not None:
        where += f", {images}, data seed {case.seed}{named(case.draw)}"
    (y, grad), traffic = run_counted(sub, run, (), f"SpatialMaxPool ({where})", timeout)
    wrong_values = _diff(y, want, "the output (your rows of one process's max pooling)")
    if wrong_values and bool(((y == 0) & (want < 0)).any()):  # the image is mostly negative: a zero is padding
        wrong_values += (
            "; some outputs are 0 where one process's max is negative: pad with -inf where there is no neighbour?"
        )
    problem = (
        wrong_values
        or (None if grad is not None else "the slab's gradient is missing: backward must return it")
        or _diff(grad, _grad(image)[:, :, rows], "the slab's gradient (did the halos' gradients go home, added?)")
        or (None if torch.equal(slab.detach(), before) else "the slab x changed: apply must leave its input as it was")
    )
    if problem:
        return f"({where}) {problem}"
    row_bytes = images.n * images.c * images.w * slab.element_size()
    owed = _pool_messages(rank, size, kernel, stride, row_bytes)
    sent = Counter((e.peer, e.nbytes) for e in traffic[rank].sends if e.peer != MPI.PROC_NULL)
    if sent != owed:
        p, q = kernel // 2, max(0, kernel // 2 + 1 - stride)
        return f"({where}) {_pool_traffic_problem(sent, owed, p, q, stride, row_bytes)}"
    return None


def check_spatial_max_pool(fn: Any, timeout: float = TIMEOUT) -> None:
    """fn: an autograd Function like ddlab.intra_layer.SpatialMaxPool: apply(x, comm, kernel, stride) -> y.

    A rank stalled `timeout` seconds inside fn fails the check (a deadlock, or a message never sent).
    The grader's draw: the ranks (each set in a drawn order) and three cases (float64, float32 and one
    drawn of them), each of a drawn odd kernel (3, 5 or 7) and stride (1 to 3), images of batch 1-3, 1-4
    channels and width 1-9, and a height whose slabs (blocks of stride rows in rank order) are each at
    least as tall as the halos they lend, the last block short or not; and their data.
    """
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "spatial_max_pool")
    cases = _pool_cases(draw)

    def every_case(sub: MPI.Comm) -> None:
        for case in cases:
            problem = _pool_case(sub, fn, case, timeout)
            context = f"SpatialMaxPool does not equal one process's max pooling on {count(sub.Get_size(), 'rank')}"
            fail_together(sub, problem, context)

    each_size(world, every_case, "SpatialMaxPool", draw=draw)
    scope = (
        "3x3 and 5x5 windows, strides 1 and 2, float64 and float32"
        if draw is None
        else ", ".join(f"{c.kernel}x{c.kernel} stride {c.stride} {_dtype_name(c.dtype)}" for c in cases)
    )
    passed(
        world,
        f"SpatialMaxPool: every slab's output rows and gradient equal one process's ({scope}), "
        f"the input unchanged; the unequal halos' messages, of their bytes{named(draw)}",
    )

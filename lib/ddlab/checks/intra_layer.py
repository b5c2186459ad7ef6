"""Checks for lab 08: the halo exchange, the filter-parallel convolution, slab bounds, the spatial max pooling.

Each runs the student's piece on the first P ranks for every P (`each_size`), through
the counting communicator (`run_counted`), and compares with one process: outputs, the
input's gradient, the weights' gradients, to 1e-10 in float64 (1e-4 in float32, whose sums
round). The halo check also counts messages: every rank sends its neighbours one message
each way per direction (forward rows, backward gradients), of halo x W x C x N x itemsize
bytes, and nothing else; it runs in float32 too, so a receive buffer made in float64 fails.
The pooling check runs float64 and float32, heights that are not a multiple of the stride,
uneven slabs, and counts the unequal halos' messages; its input must come back unchanged.
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
from ..runtime.blocks import block_bounds, block_range
from ..runtime.comm import Comm
from ._core import count, each_size, fail_together, is_integer, passed, run_counted

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


def _reference(
    kernel: int, cout: int, height: int, seed: int, padding: int | None = None, dtype: torch.dtype = torch.float64
) -> tuple[torch.nn.Conv2d, torch.Tensor, torch.Tensor]:
    """A conv (padding kernel // 2 unless given), an input and output weights; gradients filled in."""
    torch.manual_seed(seed)
    pad = kernel // 2 if padding is None else padding
    conv = torch.nn.Conv2d(C, cout, kernel, padding=pad).to(dtype)
    x = torch.randn(N, C, height, W, dtype=dtype, requires_grad=True)
    weights = torch.randn(N, cout, height + 2 * pad - kernel + 1, W + 2 * pad - kernel + 1, dtype=dtype)
    (conv(x) * weights).sum().backward()
    return conv, x, weights


# Exercise 8.1: the halo exchange --------------------------------------------------
# (kernel, image height, dtype): halos of 1 and 2 rows, uneven slabs. Height None: 3 rows per rank and one
# more, so on every size some slabs (3 rows) are thinner than their two 2-row halos together. Both
# dtypes: a receive buffer made in float64 fails the float32 case, one in float32 the float64 case.
HALO_CASES: tuple[tuple[int, int | None, torch.dtype], ...] = ((3, 10, torch.float64), (5, None, torch.float32))


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


def _halo_case(sub: MPI.Comm, fn: Any, kernel: int, height: int | None, dtype: torch.dtype) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    height = 3 * size + 1 if height is None else height
    conv, x, weights = _reference(kernel, 4, height, seed=kernel, dtype=dtype)
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
        f"{str(dtype).removeprefix('torch.')}"
    )
    (out, grad_x, grad_w, grad_b), traffic = run_counted(sub, run, (), f"HaloExchange ({where})")
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
    if problem:
        return f"({where}) {problem}"
    halo, itemsize = kernel // 2, x.element_size()
    nbytes = halo * W * C * N * itemsize
    owed = Counter({(peer, nbytes): 2 for peer in (rank - 1, rank + 1) if 0 <= peer < size})
    sent = Counter((e.peer, e.nbytes) for e in traffic[rank].sends if e.peer != MPI.PROC_NULL)
    if sent != owed:
        if sent and all(2 * n == owed[key] for key, n in sent.items()) and sent.keys() == owed.keys():
            return (
                f"({where}) sent {_describe(sent)} through the communicator passed to apply, half of "
                f"{_describe(owed)}: one direction's halos went another way. Does backward use the notebook's "
                "`comm` (MPI.COMM_WORLD) instead of the one forward was given? Keep forward's `comm` in ctx "
                "and send on it: on a sub-communicator a global one waits for ranks that are not there"
            )
        return (
            f"({where}) sent {_describe(sent)}; a halo of {halo} rows x {W} columns x {C} channels x {N} "
            f"images x {itemsize} B is {nbytes} B, one to each neighbour forward and one backward: "
            f"{_describe(owed)}{_object_api_hint(sent, owed)}"
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
            functools.partial(_halo_case, fn=fn, kernel=case[0], height=case[1], dtype=case[2]),
            "HaloExchange does not make a slab's convolution equal one process's",
            sizes,
        )
    passed(
        world,
        "HaloExchange: every slab's conv output and gradients equal one process's (float64 and float32); "
        "one halo message to each neighbour per direction, of the halo's bytes",
    )


# Exercise 8.2: the filter-parallel convolution ------------------------------------
#: (padding, dtype): the argument the signature names (1 keeps the size, 0 shrinks it, 2 grows it), and float32
#: too, so an output or gradient made in a fixed dtype fails one of them.
FILTER_CASES = ((1, torch.float64), (0, torch.float64), (2, torch.float64), (1, torch.float32))
#: The strategies' collectives, and the object forms for small values (the channel counts), as the text says.
ALLOWED = (*COLLECTIVES, "allgather", "allreduce")


def _filter_case(sub: MPI.Comm, fn: Any, padding: int, dtype: torch.dtype) -> str | None:
    conv, x, weights = _reference(3, COUT, 7, seed=2, padding=padding, dtype=dtype)
    mine = block_range(COUT, sub.Get_rank(), sub.Get_size())

    def run(counting: Any) -> tuple:
        weight, bias = filter_slice(conv, counting)
        x_ = x.detach().clone().requires_grad_()
        out = fn.apply(x_, weight, bias, counting, padding)
        (out * weights).sum().backward()
        return out, x_.grad, weight.grad, None if bias is None else bias.grad

    where = (
        f"{COUT} output channels over {sub.Get_size()} ranks, this rank's {mine.start}-{mine.stop - 1}, "
        f"padding {padding}, {str(dtype).removeprefix('torch.')}"
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
    """fn: an autograd Function like ddlab.intra_layer.FilterParallelConv: apply(x, weight, bias, comm, padding)."""
    world = MPI.COMM_WORLD
    for padding, dtype in FILTER_CASES:
        each_size(
            world,
            functools.partial(_filter_case, fn=fn, padding=padding, dtype=dtype),
            "FilterParallelConv does not equal one process's convolution",
        )
    passed(
        world,
        "FilterParallelConv: the whole output on every rank, the input's and this rank's weight "
        "gradients equal one process's",
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


# Exercise 8.4: the spatial max pooling ---------------------------------------------
# (kernel, stride, dtype): ResNet's stem pool (halos of 1 row above, none below), a 5x5 window with
# stride 2 (2 above, 1 below) and a 3x3 with stride 1 (1 and 1); float64 and float32 (a receive
# buffer made in the other dtype fails one of them).
POOL_CASES: tuple[tuple[int, int, torch.dtype], ...] = (
    (3, 2, torch.float64),
    (5, 2, torch.float32),
    (3, 1, torch.float64),
)
POOL_WIDTH = 7  # odd: the columns' -inf padding matters at both sides


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


def _pool_case(sub: MPI.Comm, fn: Any, kernel: int, stride: int, dtype: torch.dtype, timeout: float) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    height = stride * (2 * size + 1) + 1  # not a multiple of the stride (if > 1); uneven slabs on 3 and 4 ranks
    bounds = pool_bounds(height, size, stride)
    rows, outs = (
        slice(bounds[rank], bounds[rank + 1]),
        slice(-(-bounds[rank] // stride), -(-bounds[rank + 1] // stride)),
    )
    torch.manual_seed(kernel * 10 + stride)
    image = (torch.randn(N, C, height, POOL_WIDTH, dtype=dtype) - 2).requires_grad_()  # mostly negative: -inf, not 0
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
        f"on this rank, {str(dtype).removeprefix('torch.')}"
    )
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
    row_bytes = N * C * POOL_WIDTH * slab.element_size()
    owed = _pool_messages(rank, size, kernel, stride, row_bytes)
    sent = Counter((e.peer, e.nbytes) for e in traffic[rank].sends if e.peer != MPI.PROC_NULL)
    if sent != owed:
        p, q = kernel // 2, max(0, kernel // 2 + 1 - stride)
        return f"({where}) {_pool_traffic_problem(sent, owed, p, q, stride, row_bytes)}"
    return None


def check_spatial_max_pool(fn: Any, timeout: float = TIMEOUT) -> None:
    """fn: an autograd Function like ddlab.intra_layer.SpatialMaxPool: apply(x, comm, kernel, stride) -> y.

    A rank stalled `timeout` seconds inside fn fails the check (a deadlock, or a message never sent).
    """
    world = MPI.COMM_WORLD

    def every_case(sub: MPI.Comm) -> None:
        for kernel, stride, dtype in POOL_CASES:
            problem = _pool_case(sub, fn, kernel, stride, dtype, timeout)
            context = f"SpatialMaxPool does not equal one process's max pooling on {count(sub.Get_size(), 'rank')}"
            fail_together(sub, problem, context)

    each_size(world, every_case, "SpatialMaxPool")
    passed(
        world,
        "SpatialMaxPool: every slab's output rows and gradient equal one process's (3x3 and 5x5 windows, "
        "strides 1 and 2, float64 and float32), the input unchanged; the unequal halos' messages, of their bytes",
    )

"""Lab 08's checks fail wrong answers on every rank, without hanging, and pass valid alternatives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ddlab.checks import (
    CheckFailed,
    check_filter_parallel_conv,
    check_halo_exchange,
    check_slab_bounds,
    check_spatial_max_pool,
)
from ddlab.intra_layer import FilterParallelConv, HaloExchange, SpatialMaxPool, pool_halos, slab_bounds
from ddlab.intra_layer.halo import exchange_rows
from ddlab.runtime.blocks import block_bounds
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
FilterParallelConv = unguarded(FilterParallelConv)
HaloExchange = unguarded(HaloExchange)
SpatialMaxPool = unguarded(SpatialMaxPool)
slab_bounds = unguarded(slab_bounds)
exchange_rows = unguarded(exchange_rows)

WORLD = MPI.COMM_WORLD


class HaloForgetsBackward(HaloExchange):
    """Forward right; backward keeps the halo's gradient instead of sending it home."""

    @staticmethod
    def backward(ctx, grad_above, grad_below):
        return grad_above.new_zeros(grad_above.shape[0], grad_above.shape[1], ctx.rows, grad_above.shape[3]), None, None


class HaloGlobalBackward(HaloExchange):
    """Backward sends on the notebook's global communicator, blocking: on a sub-communicator it would deadlock."""

    @staticmethod
    def backward(ctx, grad_above, grad_below):
        rank, size = WORLD.Get_rank(), ctx.comm.Get_size()
        grad_x = grad_above.new_zeros(grad_above.shape[0], grad_above.shape[1], ctx.rows, grad_above.shape[3])
        from_above, from_below = torch.zeros_like(grad_above), torch.zeros_like(grad_below)
        up = rank - 1 if rank > 0 else MPI.PROC_NULL
        down = rank + 1 if rank + 1 < WORLD.Get_size() else MPI.PROC_NULL
        WORLD.Sendrecv(grad_above.contiguous().numpy(), up, 5, from_below.numpy(), down, 5)
        WORLD.Sendrecv(grad_below.contiguous().numpy(), down, 6, from_above.numpy(), up, 6)
        if rank > 0:
            grad_x[:, :, : ctx.halo] += from_above
        if rank + 1 < size:
            grad_x[:, :, -ctx.halo :] += from_below
        return grad_x, None, None


class HaloOneRow(HaloExchange):
    """Always exchanges one row, whatever the kernel needs."""

    @staticmethod
    def forward(ctx, x, comm, halo):
        return HaloExchange.forward(ctx, x, comm, 1)


class HaloWrongRows(HaloExchange):
    """Sends each neighbour the wrong boundary: its bottom rows up and its top rows down."""

    @staticmethod
    def forward(ctx, x, comm, halo):
        ctx.comm, ctx.halo, ctx.rows = comm, halo, x.shape[2]
        above, below = exchange_rows(comm, x[:, :, -halo:], x[:, :, :halo], (81, 82))
        zeros = x.new_zeros(x.shape[0], x.shape[1], halo, x.shape[3])
        return (zeros if above is None else above), (zeros.clone() if below is None else below)


class HaloWrapsAround(HaloExchange):
    """Treats the ranks as a ring: the first and last ranks swap rows although they are no neighbours."""

    @staticmethod
    def forward(ctx, x, comm, halo):
        ctx.comm, ctx.halo, ctx.rows = comm, halo, x.shape[2]
        rank, size = comm.Get_rank(), comm.Get_size()
        up, down = torch.empty_like(x[:, :, :halo]), torch.empty_like(x[:, :, :halo])
        comm.Sendrecv(
            x[:, :, :halo].contiguous().numpy(),
            dest=(rank - 1) % size,
            sendtag=1,
            recvbuf=down.numpy(),
            source=(rank + 1) % size,
            recvtag=1,
        )
        comm.Sendrecv(
            x[:, :, -halo:].contiguous().numpy(),
            dest=(rank + 1) % size,
            sendtag=2,
            recvbuf=up.numpy(),
            source=(rank - 1) % size,
            recvtag=2,
        )
        return up, down


class HaloObjectAPI(HaloExchange):
    """Right values, forward's halos sent as pickled tensors (lower-case sendrecv): more bytes than the rows."""

    @staticmethod
    def forward(ctx, x, comm, halo):
        ctx.comm, ctx.halo, ctx.rows = comm, halo, x.shape[2]
        rank, size = comm.Get_rank(), comm.Get_size()
        up = rank - 1 if rank > 0 else MPI.PROC_NULL
        down = rank + 1 if rank < size - 1 else MPI.PROC_NULL
        below = comm.sendrecv(x[:, :, :halo].detach().clone(), dest=up, sendtag=1, source=down, recvtag=1)
        above = comm.sendrecv(x[:, :, -halo:].detach().clone(), dest=down, sendtag=2, source=up, recvtag=2)
        zeros = x.new_zeros(x.shape[0], x.shape[1], halo, x.shape[3])
        return (zeros if above is None else above), (zeros.clone() if below is None else below)


class HaloOverwrites(HaloExchange):
    """Backward writes the neighbours' gradients into the boundary rows instead of adding them."""

    @staticmethod
    def backward(ctx, grad_above, grad_below):
        from_above, from_below = exchange_rows(ctx.comm, grad_above, grad_below, (83, 84))
        grad_x = grad_above.new_zeros(grad_above.shape[0], grad_above.shape[1], ctx.rows, grad_above.shape[3])
        if from_above is not None:
            grad_x[:, :, : ctx.halo] = from_above
        if from_below is not None:
            grad_x[:, :, -ctx.halo :] = from_below
        return grad_x, None, None


class HaloSendrecv(torch.autograd.Function):
    """A valid alternative: blocking Sendrecv to both sides, MPI.PROC_NULL at the edges, fresh tensors."""

    @staticmethod
    def _swap(comm, up, down):
        rank, size = comm.Get_rank(), comm.Get_size()
        above_rank = rank - 1 if rank > 0 else MPI.PROC_NULL
        below_rank = rank + 1 if rank < size - 1 else MPI.PROC_NULL
        from_below, from_above = torch.zeros_like(up), torch.zeros_like(down)
        comm.Sendrecv(
            up.contiguous().numpy(),
            dest=above_rank,
            sendtag=7,
            recvbuf=from_below.numpy(),
            source=below_rank,
            recvtag=7,
        )
        comm.Sendrecv(
            down.contiguous().numpy(),
            dest=below_rank,
            sendtag=8,
            recvbuf=from_above.numpy(),
            source=above_rank,
            recvtag=8,
        )
        return from_above, from_below

    @staticmethod
    def forward(ctx, x, comm, halo):
        ctx.comm, ctx.halo, ctx.shape = comm, halo, x.shape
        return HaloSendrecv._swap(comm, x[:, :, :halo], x[:, :, -halo:])

    @staticmethod
    def backward(ctx, grad_above, grad_below):
        from_above, from_below = HaloSendrecv._swap(ctx.comm, grad_above, grad_below)
        grad = torch.nn.functional.pad(from_above, (0, 0, 0, ctx.shape[2] - ctx.halo))
        grad = grad + torch.nn.functional.pad(from_below, (0, 0, ctx.shape[2] - ctx.halo, 0))
        return grad, None, None


def halo_receiving_into(dtype: torch.dtype) -> type[HaloExchange]:
    """A halo exchange that receives into `dtype` buffers whatever the slab's dtype."""

    class HaloBuffer(HaloExchange):
        @staticmethod
        def forward(ctx, x, comm, halo):
            ctx.comm, ctx.halo, ctx.rows = comm, halo, x.shape[2]
            rank, size = comm.Get_rank(), comm.Get_size()
            above, below = (torch.zeros(x.shape[0], x.shape[1], halo, x.shape[3], dtype=dtype) for _ in range(2))
            up = rank - 1 if rank > 0 else MPI.PROC_NULL
            down = rank + 1 if rank < size - 1 else MPI.PROC_NULL
            comm.Sendrecv(x[:, :, :halo].contiguous().numpy(), up, 1, below.numpy(), down, 1)
            comm.Sendrecv(x[:, :, -halo:].contiguous().numpy(), down, 2, above.numpy(), up, 2)
            return above, below

    return HaloBuffer


#: float64 buffers for a float32 slab: the halo comes back in the wrong dtype.
HaloBufferIn = halo_receiving_into(torch.float64)
#: float32 buffers (torch.zeros's default) for a float64 slab: the message overflows them.
HaloFloat32Buffer = halo_receiving_into(torch.float32)


class HaloStub(HaloExchange):
    @staticmethod
    def forward(ctx, x, comm, halo):
        raise NotImplementedError("Exercise 8.1 (HaloExchange) is not done yet: write it where this line is.")


class FilterSums(FilterParallelConv):
    """Sums the ranks' outputs (each in the first channels) instead of gathering them side by side."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, padding):
        whole = FilterParallelConv.forward(ctx, x, weight, bias, comm, padding)
        mine = torch.zeros_like(whole)
        mine[:, : weight.shape[0]] = F.conv2d(x, weight, bias, padding=padding)
        out = torch.empty_like(mine)
        comm.Allreduce(mine.numpy(), out.numpy())
        return out


class FilterFixedPadding(FilterParallelConv):
    """Pads by 1 whatever padding it is given (the only padding of a 3x3 conv that keeps the size)."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, padding):
        return FilterParallelConv.forward(ctx, x, weight, bias, comm, 1)


class FilterByAllreduce(torch.autograd.Function):
    """A valid alternative: my channels in place in a zero tensor, summed over ranks; backward also one Allreduce."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, padding):
        counts = [0] * comm.Get_size()
        counts[comm.Get_rank()] = weight.shape[0]
        sizes = torch.zeros(comm.Get_size(), dtype=torch.float64)
        comm.Allreduce(torch.tensor(counts, dtype=torch.float64).numpy(), sizes.numpy())
        start = int(sizes[: comm.Get_rank()].sum())
        own = F.conv2d(x, weight, bias, padding=padding)
        mine = torch.zeros(x.shape[0], int(sizes.sum()), own.shape[2], own.shape[3], dtype=x.dtype)
        mine[:, start : start + weight.shape[0]] = own
        out = torch.empty_like(mine)
        comm.Allreduce(mine.numpy(), out.numpy())
        ctx.save_for_backward(x, weight, bias)
        ctx.comm, ctx.padding, ctx.start = comm, padding, start
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_, b_ = (t.detach().requires_grad_() for t in (x, weight, bias))
            y = F.conv2d(x_, w_, b_, padding=ctx.padding)
            gx, gw, gb = torch.autograd.grad(y, (x_, w_, b_), grad[:, ctx.start : ctx.start + weight.shape[0]])
        total = torch.empty_like(gx)
        ctx.comm.Allreduce(gx.contiguous().numpy(), total.numpy())
        return total, gw, gb, None, None


class FilterForgetsSum(FilterParallelConv):
    """Backward returns this rank's partial input gradient, not the sum over ranks."""

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        mine = grad[:, ctx.start : ctx.start + weight.shape[0]]
        grad_x = torch.nn.grad.conv2d_input(x.shape, weight, mine, padding=ctx.padding)
        grad_w = torch.nn.grad.conv2d_weight(x, weight.shape, mine, padding=ctx.padding)
        return grad_x, grad_w, mine.sum(dim=(0, 2, 3)), None, None


def slabs_ignore_pooling(height, size, levels):
    return block_bounds(height, size)


def slabs_remainder_last(height, size, levels):
    """Whole blocks of 2**levels rows, but a height that is not a multiple of them is taken: the rest in the last slab."""
    unit = 2**levels
    if height // unit < size:
        raise ValueError("too few blocks")
    bounds = [unit * b for b in block_bounds(height // unit, size)]
    bounds[-1] = height
    return bounds


def slabs_extra_rows_last(height, size, levels):
    """A valid alternative: the larger slabs at the bottom."""
    unit = 2**levels
    if height % unit or height // unit < size:
        raise ValueError("cannot cut")
    blocks = block_bounds(height // unit, size)
    sizes = [b - a for a, b in zip(blocks, blocks[1:])][::-1]
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n * unit)
    return bounds


def slabs_as_numpy(height, size, levels):
    """Valid: the reference's bounds as a NumPy array of int64."""
    return np.asarray(slab_bounds(height, size, levels), dtype=np.int64)


def test_reference_and_valid_alternatives_pass():
    check_halo_exchange(HaloExchange)
    check_halo_exchange(HaloSendrecv)
    check_filter_parallel_conv(FilterParallelConv)
    check_filter_parallel_conv(FilterByAllreduce)
    check_slab_bounds(slab_bounds)
    check_slab_bounds(slabs_extra_rows_last)
    check_slab_bounds(slabs_as_numpy)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (HaloForgetsBackward, "gradient"),
        (HaloOneRow, "shape"),
        (HaloWrongRows, "output"),
        (HaloWrapsAround, "output|sent"),
        (HaloOverwrites, "slab's gradient"),
        (HaloGlobalBackward, "half of .*notebook's `comm`"),
        (HaloObjectAPI, "(?s)a halo of .* B is .*pickled object API.*Sendrecv"),
        (HaloBufferIn, "(?s)float32.*dtype torch.float64, the slab's is torch.float32: was a receive buffer"),
        (HaloFloat32Buffer, "(?s)float64.*MPI.*receive buffer was smaller than its message"),
    ],
)
def test_wrong_halo_fails(wrong, says):
    with pytest.raises(CheckFailed, match=says):
        check_halo_exchange(wrong)


def test_filter_that_ignores_padding_fails():
    with pytest.raises(CheckFailed, match="(?s)padding 0.*(size|shape)"):
        check_filter_parallel_conv(FilterFixedPadding)


def test_filter_that_sums_fails():
    with pytest.raises(CheckFailed, match="output"):
        check_filter_parallel_conv(FilterSums)


def test_filter_that_forgets_to_sum_the_input_gradient_fails():
    with pytest.raises(CheckFailed, match="input's gradient"):
        check_filter_parallel_conv(FilterForgetsSum)


def test_slabs_that_break_at_a_pooling_level_fail():
    with pytest.raises(CheckFailed, match="not a multiple of 2\\*\\*levels"):
        check_slab_bounds(slabs_ignore_pooling)


def test_slabs_of_a_height_the_poolings_cannot_halve_fail():
    with pytest.raises(CheckFailed, match="(?s)not a multiple of 2\\*\\*levels = 8.*raise ValueError.*valid heights"):
        check_slab_bounds(slabs_remainder_last)


def test_stub_raises_not_implemented_on_every_rank():
    with pytest.raises(NotImplementedError, match="Exercise 8.1"):
        check_halo_exchange(HaloStub)
    check_halo_exchange(HaloExchange)  # and the ranks are still in step afterwards


# Exercise 8.4: the spatial max pooling ---------------------------------------------------------


def _fill(x, rows, value=-torch.inf, dtype=None):
    return torch.full((x.shape[0], x.shape[1], max(rows, 0), x.shape[3]), value, dtype=dtype or x.dtype)


def _bottom(h, kernel, stride):
    """Padding rows under the last slab: as far as its last window reaches."""
    return ((h + stride - 1) // stride - 1) * stride + kernel // 2 + 1 - h


def _pool_forward(ctx, x, comm, kernel, stride, edge=-torch.inf, buffer=None):
    """Isend/Irecv and one Waitall; halos received into `buffer`-typed tensors (x's dtype unless given)."""
    rank, size, h = comm.Get_rank(), comm.Get_size(), x.shape[2]
    p, q = kernel // 2, max(0, kernel // 2 + 1 - stride)
    above, below = _fill(x, p, edge, buffer), _fill(x, q, edge, buffer)
    requests, keep = [], []
    if rank > 0:
        requests.append(comm.Irecv(above.numpy(), source=rank - 1, tag=3))
        if q:
            keep.append(x[:, :, :q].contiguous().numpy())
            requests.append(comm.Isend(keep[-1], dest=rank - 1, tag=4))
    if rank < size - 1:
        keep.append(x[:, :, h - p :].contiguous().numpy())
        requests.append(comm.Isend(keep[-1], dest=rank + 1, tag=3))
        if q:
            requests.append(comm.Irecv(below.numpy(), source=rank + 1, tag=4))
    MPI.Request.Waitall(requests)
    if rank == size - 1:
        below = _fill(x, _bottom(h, kernel, stride), edge)
    return _pooled(ctx, torch.cat([above, x.detach(), below], dim=2), comm, kernel, stride, h)


def _pooled(ctx, padded, comm, kernel, stride, h):
    ctx.save_for_backward(padded)
    ctx.comm, ctx.kernel, ctx.stride, ctx.h = comm, kernel, stride, h
    return F.max_pool2d(padded, kernel, stride, padding=(0, kernel // 2))


class PoolByAutograd(torch.autograd.Function):
    """A valid alternative: Isend/Irecv and one Waitall, explicit edges, backward by autograd on the padded slab."""

    @staticmethod
    def forward(ctx, x, comm, kernel, stride):
        return _pool_forward(ctx, x, comm, kernel, stride)

    @staticmethod
    def backward(ctx, grad):
        (padded,) = ctx.saved_tensors
        comm, h = ctx.comm, ctx.h
        rank, size = comm.Get_rank(), comm.Get_size()
        p, q = pool_halos(ctx.kernel, ctx.stride)
        with torch.enable_grad():
            leaf = padded.detach().requires_grad_()
            (g,) = torch.autograd.grad(F.max_pool2d(leaf, ctx.kernel, ctx.stride, padding=(0, p)), leaf, grad)
        grad_x = g[:, :, p : p + h].clone()
        from_above, from_below = torch.zeros_like(grad_x[:, :, :q]), torch.zeros_like(grad_x[:, :, h - p :])
        requests, keep = [], [g[:, :, :p].contiguous().numpy(), g[:, :, p + h : p + h + q].contiguous().numpy()]
        if rank > 0:
            requests.append(comm.Isend(keep[0], dest=rank - 1, tag=5))
            if q:
                requests.append(comm.Irecv(from_above.numpy(), source=rank - 1, tag=6))
        if rank < size - 1:
            requests.append(comm.Irecv(from_below.numpy(), source=rank + 1, tag=5))
            if q:
                requests.append(comm.Isend(keep[1], dest=rank + 1, tag=6))
        MPI.Request.Waitall(requests)
        grad_x[:, :, :q] += from_above
        grad_x[:, :, h - p :] += from_below
        return grad_x, None, None, None


class PoolZeroEdges(PoolByAutograd):
    """Pads the image's top and bottom with zeros, as a convolution's halo does: wrong for a max."""

    @staticmethod
    def forward(ctx, x, comm, kernel, stride):
        return _pool_forward(ctx, x, comm, kernel, stride, edge=0.0)


class PoolInFloat64(PoolByAutograd):
    """Receives the halos into float64 buffers whatever the slab's dtype."""

    @staticmethod
    def forward(ctx, x, comm, kernel, stride):
        return _pool_forward(ctx, x, comm, kernel, stride, buffer=torch.float64)


class PoolFloat32Sendrecv(PoolByAutograd):
    """Sendrecv into float32 buffers (torch.full's default dtype), for a float64 slab too: the message overflows them."""

    @staticmethod
    def forward(ctx, x, comm, kernel, stride):
        rank, size, h = comm.Get_rank(), comm.Get_size(), x.shape[2]
        p, q = pool_halos(kernel, stride)
        up = rank - 1 if rank > 0 else MPI.PROC_NULL
        down = rank + 1 if rank < size - 1 else MPI.PROC_NULL
        above = torch.full((x.shape[0], x.shape[1], p, x.shape[3]), -torch.inf)
        below = torch.full((x.shape[0], x.shape[1], q, x.shape[3]), -torch.inf)
        comm.Sendrecv(x[:, :, h - p :].contiguous().numpy(), down, 3, above.numpy(), up, 3)
        if q:
            comm.Sendrecv(x[:, :, :q].contiguous().numpy(), up, 4, below.numpy(), down, 4)
        below = _fill(x, _bottom(h, kernel, stride)) if rank == size - 1 else below
        return _pooled(ctx, torch.cat([above, x.detach(), below], dim=2), comm, kernel, stride, h)


class PoolAlone(PoolByAutograd):
    """Pools each slab on its own with -inf padding: no halo, wrong where a window crosses the slab's edge."""

    @staticmethod
    def forward(ctx, x, comm, kernel, stride):
        h, p = x.shape[2], kernel // 2
        below = _fill(x, _bottom(h, kernel, stride))
        return _pooled(ctx, torch.cat([_fill(x, p), x.detach(), below], dim=2), comm, kernel, stride, h)

    @staticmethod
    def backward(ctx, grad):
        (padded,) = ctx.saved_tensors
        p = ctx.kernel // 2
        with torch.enable_grad():
            leaf = padded.detach().requires_grad_()
            (g,) = torch.autograd.grad(F.max_pool2d(leaf, ctx.kernel, ctx.stride, padding=(0, p)), leaf, grad)
        return g[:, :, p : p + ctx.h].clone(), None, None, None


class PoolSymmetricHalo(PoolByAutograd):
    """Right values, but every halo is kernel // 2 rows both ways (as for a convolution), the extra rows unused."""

    @staticmethod
    def forward(ctx, x, comm, kernel, stride):
        rank, size, h = comm.Get_rank(), comm.Get_size(), x.shape[2]
        p, q = pool_halos(kernel, stride)
        above, below = exchange_rows(comm, x[:, :, :p], x[:, :, h - p :], (97, 98))
        above = _fill(x, p) if above is None else above
        below = _fill(x, _bottom(h, kernel, stride)) if rank == size - 1 else below[:, :, :q]
        return _pooled(ctx, torch.cat([above, x.detach(), below], dim=2), comm, kernel, stride, h)


class PoolObjectAPI(PoolByAutograd):
    """Right values and messages, forward sent with the object API (pickled): more bytes than the lab states."""

    @staticmethod
    def forward(ctx, x, comm, kernel, stride):
        rank, size, h = comm.Get_rank(), comm.Get_size(), x.shape[2]
        p, q = pool_halos(kernel, stride)
        up = rank - 1 if rank > 0 else MPI.PROC_NULL
        down = rank + 1 if rank < size - 1 else MPI.PROC_NULL
        above = comm.sendrecv(x[:, :, h - p :].clone(), dest=down, sendtag=3, source=up, recvtag=3)
        below = comm.sendrecv(x[:, :, :q].clone(), dest=up, sendtag=4, source=down, recvtag=4) if q else _fill(x, 0)
        above = _fill(x, p) if above is None else above
        below = _fill(x, _bottom(h, kernel, stride)) if rank == size - 1 else below
        return _pooled(ctx, torch.cat([above, x.detach(), below], dim=2), comm, kernel, stride, h)


class PoolKeepsHaloGradient(SpatialMaxPool):
    """Backward returns the slab's own rows' gradient and sends nothing home."""

    @staticmethod
    def backward(ctx, grad):
        (p, _), h, (n, c, rows, w) = ctx.halos, ctx.rows, ctx.padded
        spread = grad.new_zeros(n, c, rows * w).scatter_add_(2, ctx.where.flatten(2), grad.flatten(2))
        return spread.view(n, c, rows, w)[:, :, p : p + h].clone(), None, None, None


class PoolOverwrites(SpatialMaxPool):
    """Backward writes the neighbours' gradients over the boundary rows' instead of adding them."""

    @staticmethod
    def backward(ctx, grad):
        (p, q), h, (n, c, rows, w) = ctx.halos, ctx.rows, ctx.padded
        spread = grad.new_zeros(n, c, rows * w).scatter_add_(2, ctx.where.flatten(2), grad.flatten(2))
        spread = spread.view(n, c, rows, w)
        sent = (spread[:, :, :p], spread[:, :, p + h : p + h + q])
        from_above, from_below = exchange_rows(ctx.comm, *sent, (87, 88), (q, p))
        grad_x = spread[:, :, p : p + h].clone()
        if from_above is not None:
            grad_x[:, :, :q] = from_above
        if from_below is not None:
            grad_x[:, :, h - p :] = from_below
        return grad_x, None, None, None


class PoolReusesSlab(SpatialMaxPool):
    """Right output and gradient, but uses the caller's slab as scratch space: its first row overwritten."""

    @staticmethod
    def forward(ctx, x, comm, kernel, stride):
        y = SpatialMaxPool.forward(ctx, x, comm, kernel, stride)
        if comm.Get_rank() > 0:
            x.detach()[:, :, :1] = -1e30  # "scratch space": the caller's tensor
        return y


class PoolWaitsBelow(SpatialMaxPool):
    """Also waits for kernel // 2 rows from below, which no neighbour sends when the stride is 2: never completes."""

    @staticmethod
    def forward(ctx, x, comm, kernel, stride):
        y = SpatialMaxPool.forward(ctx, x, comm, kernel, stride)
        rank, p = comm.Get_rank(), kernel // 2
        if rank < comm.Get_size() - 1:
            comm.Recv(torch.empty(x.shape[0], x.shape[1], p, x.shape[3], dtype=x.dtype).numpy(), rank + 1, 99)
        return y


class PoolStub(SpatialMaxPool):
    @staticmethod
    def forward(ctx, x, comm, kernel, stride):
        raise NotImplementedError("Exercise 8.4 (SpatialMaxPool) is not done yet: write it where this line is.")


def test_pool_reference_and_valid_alternative_pass():
    check_spatial_max_pool(SpatialMaxPool)
    check_spatial_max_pool(PoolByAutograd)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (PoolZeroEdges, "(?s)output.*0 where one process's max is negative: pad with -inf where there is no neighbour"),
        (PoolAlone, "(?s)^(?!.*pad with -inf).*the output"),  # -inf edges, no halos: zero padding is not the cause
        (PoolSymmetricHalo, "more bytes than the windows read"),
        (PoolObjectAPI, "pickled object API"),
        (PoolInFloat64, "(?s)float32.*dtype torch.float64, expected torch.float32: was a receive buffer"),
        (PoolFloat32Sendrecv, "(?s)float64.*MPI.*receive buffer was smaller than its message"),
        (PoolKeepsHaloGradient, "slab's gradient"),
        (PoolOverwrites, "slab's gradient"),
        (PoolReusesSlab, "the slab x changed"),
    ],
)
def test_wrong_pool_fails(wrong, says):
    with pytest.raises(CheckFailed, match=says):
        check_spatial_max_pool(wrong)


def test_pool_that_never_completes_fails_within_its_timeout():
    start = MPI.Wtime()
    with pytest.raises(CheckFailed, match="(?s)SpatialMaxPool.*(waited|Stalled)"):
        check_spatial_max_pool(PoolWaitsBelow, timeout=2.0)
    assert MPI.Wtime() - start < 15.0


def test_pool_stub_raises_not_implemented_on_every_rank():
    with pytest.raises(NotImplementedError, match="Exercise 8.4"):
        check_spatial_max_pool(PoolStub)


class FilterObjectCounts(FilterParallelConv):
    """A valid alternative: the channel counts by the object form, comm.allgather(int); the output by Allgatherv."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, padding):
        counts = np.array(comm.allgather(weight.shape[0]), dtype=np.int64)
        mine = F.conv2d(x, weight, bias, padding=padding)
        n, _, h, w = mine.shape
        whole = torch.empty(int(counts.sum()), n, h, w, dtype=x.dtype)
        comm.Allgatherv(mine.transpose(0, 1).contiguous().numpy(), [whole.numpy(), (counts * n * h * w).tolist()])
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.padding, ctx.has_bias = comm, padding, bias is not None
        ctx.start = int(counts[: comm.Get_rank()].sum())
        return whole.transpose(0, 1).contiguous()


class FilterObjectTotal(FilterObjectCounts):
    """Also valid: the number of all channels by the object allreduce, comm.allreduce(int)."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, padding):
        total = comm.allreduce(weight.shape[0])
        whole = FilterObjectCounts.forward(ctx, x, weight, bias, comm, padding)
        assert whole.shape[1] == total
        return whole


class FilterPickledOutput(FilterParallelConv):
    """Gathers the output tensors themselves with the object form: pickled data, which the text forbids."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, padding):
        blocks = comm.allgather(F.conv2d(x, weight, bias, padding=padding))
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.padding, ctx.has_bias = comm, padding, bias is not None
        ctx.start = sum(b.shape[1] for b in blocks[: comm.Get_rank()])
        return torch.cat(blocks, dim=1)


def test_filter_object_form_for_the_counts_passes():
    check_filter_parallel_conv(FilterObjectCounts)
    check_filter_parallel_conv(FilterObjectTotal)


def test_filter_pickling_the_output_fails():
    with pytest.raises(CheckFailed, match="(?s)comm.allgather pickled a Tensor.*Allgatherv"):
        check_filter_parallel_conv(FilterPickledOutput)


class FilterFloat64Output(FilterParallelConv):
    """Gathers into a float64 tensor whatever x's dtype: right in float64, the wrong dtype for float32."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, padding):
        return FilterParallelConv.forward(ctx, x, weight, bias, comm, padding).to(torch.float64)


def test_filter_in_the_wrong_dtype_fails():
    with pytest.raises(
        CheckFailed,
        match="(?s)float32.*(dtype torch.float64, expected torch.float32|expected scalar type Double but found Float)",
    ):
        check_filter_parallel_conv(FilterFloat64Output)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("halo_exchange", "ddlab.intra_layer.HaloExchange", ()),
        ("filter_parallel_conv", "ddlab.intra_layer.FilterParallelConv", ()),
        ("slab_bounds", "ddlab.intra_layer.slab_bounds", ()),
        ("spatial_max_pool", "ddlab.intra_layer.SpatialMaxPool", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)

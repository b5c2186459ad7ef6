"""The grader's draw for labs 08 and 10: their checks graded on cases the notebook never shows.

With DDLAB_GRADE_SEED set (as `ddlab grade --seed S` sets it in the kernel and its engines), every
check of lab 08 (intra-layer parallelism) and lab 10 (parameter servers) draws its ranks, in a drawn
order, and its cases within what the lab's text promises. The library's answers pass under every seed
and without one; each answer fitted to the notebook's cases below passes the notebook's check and
fails under a seed, with the drawn case and the seed named.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ddlab.checks import (
    CheckFailed,
    check_async_worker,
    check_filter_parallel_conv,
    check_gossip_step,
    check_halo_exchange,
    check_slab_bounds,
    check_spatial_max_pool,
    check_ssp_gate,
    check_ssp_server,
)
from ddlab.checks._draw import Draw
from ddlab.checks.intra_layer import _pool_cases, _pool_height, pool_bounds
from ddlab.checks.parameter_server import _bounds, _tables
from ddlab.intra_layer import FilterParallelConv, HaloExchange, SpatialMaxPool, slab_bounds
from ddlab.parameter_server import Consistency, gossip_step, may_start
from ddlab.parameter_server.messages import GRADIENT, PARAMETERS, PARAMETERS_HEADER
from ddlab.parameter_server.server import Server
from ddlab.parameter_server.worker import work
from ddlab.runtime.reference import unguarded
from mpi4py import MPI
from torch.nn.grad import conv2d_input, conv2d_weight

#: Like their checks' wrong-answer tests (tests/test_mpi_suites.py runs test_*_checks.py on 4 ranks only), these
#: run on the labs' 4 ranks; on 3 they pass too (checked) but would double their time in `make test`.
pytestmark = pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() != 4, reason="labs 08 and 10's checks are tested on the labs' 4 ranks"
)

SHORT = 5.0  # seconds a fitted answer may wait for a message that never comes

may_start = unguarded(may_start)


# The library's answers, as valid ones --------------------------------------------------


def async_worker(comm, n, gradient, steps):
    """The library's worker (Irecv/Isend) against one server on rank 0."""
    unguarded(work)(comm, [(0, n)], n, comm.Get_rank(), gradient, steps, comm.watch)


def ssp_server(comm, params, steps, bound, lr):
    """The library's stale-synchronous server."""
    server = unguarded(Server)(comm, params, list(range(1, comm.Get_size())), steps, lr, Consistency(bound), comm.watch)
    server.serve()
    return server.params


RIGHT = [
    (check_halo_exchange, unguarded(HaloExchange)),
    (check_filter_parallel_conv, unguarded(FilterParallelConv)),
    (check_slab_bounds, unguarded(slab_bounds)),
    (check_spatial_max_pool, unguarded(SpatialMaxPool)),
    (check_ssp_gate, may_start),
    (check_async_worker, async_worker),
    (check_ssp_server, ssp_server),
    (check_gossip_step, unguarded(gossip_step)),
]


@pytest.mark.parametrize("check, right", RIGHT, ids=lambda v: getattr(v, "__name__", ""))
def test_the_library_s_answer_passes_without_a_seed_and_under_every_seed(comm, passes_on_every_seed, check, right):
    passes_on_every_seed(lambda: check(right), comm=comm)


# Answers fitted to the notebook's cases ------------------------------------------------


class FilterConvByWorldRank(torch.autograd.Function):
    """Lab 08's filter-parallel convolution finding its channels by the world's rank: right on the first P ranks."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, padding):
        mine = F.conv2d(x, weight, bias, padding=padding)
        counts = np.empty(comm.Get_size(), dtype=np.int64)
        comm.Allgather(np.array([weight.shape[0]], dtype=np.int64), counts)
        n, _, h, w = mine.shape
        whole = torch.empty(int(counts.sum()), n, h, w, dtype=x.dtype)
        comm.Allgatherv(mine.transpose(0, 1).contiguous().numpy(), [whole.numpy(), (counts * n * h * w).tolist()])
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.padding = comm, padding
        ctx.start = int(counts[: MPI.COMM_WORLD.Get_rank()].sum())  # the world's rank, not comm's
        return whole.transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        mine = grad[:, ctx.start : ctx.start + weight.shape[0]]
        partial = conv2d_input(x.shape, weight, mine, padding=ctx.padding).contiguous()
        grad_x = torch.empty_like(partial)
        ctx.comm.Allreduce(partial.numpy(), grad_x.numpy(), op=MPI.SUM)
        grad_weight = conv2d_weight(x, weight.shape, mine, padding=ctx.padding)
        return grad_x, grad_weight, mine.sum(dim=(0, 2, 3)), None, None


def swap_by_world_rank(comm, up, down):
    """Lab 08's swap with neighbours numbered by the world's rank: right on the first P ranks."""
    rank, size = MPI.COMM_WORLD.Get_rank(), comm.Get_size()
    above = rank - 1 if rank > 0 else MPI.PROC_NULL
    below = rank + 1 if rank < size - 1 else MPI.PROC_NULL
    from_above, from_below = torch.zeros_like(down), torch.zeros_like(up)
    comm.Sendrecv(up.detach().contiguous().numpy(), above, 1, from_below.numpy(), below, 1)
    comm.Sendrecv(down.detach().contiguous().numpy(), below, 2, from_above.numpy(), above, 2)
    return from_above, from_below


class HaloByWorldRank(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, halo):
        ctx.comm, ctx.halo, ctx.rows = comm, halo, x.shape[2]
        return swap_by_world_rank(comm, x[:, :, :halo], x[:, :, -halo:])

    @staticmethod
    def backward(ctx, grad_above, grad_below):
        from_above, from_below = swap_by_world_rank(ctx.comm, grad_above, grad_below)
        n, c, _, w = grad_above.shape
        grad = grad_above.new_zeros(n, c, ctx.rows, w)
        grad[:, :, : ctx.halo] += from_above
        grad[:, :, -ctx.halo :] += from_below
        return grad, None, None


class PoolWithoutTheFloor(torch.autograd.Function):
    """Lab 08's spatial max pooling with q = p + 1 - stride, not max(0, ...): right for the notebook's strides."""

    @staticmethod
    def forward(ctx, x, comm, kernel, stride):
        rank, size = comm.Get_rank(), comm.Get_size()
        n, c, h, w = x.shape
        p, q = kernel // 2, kernel // 2 + 1 - stride  # negative once the stride passes p + 1
        up = rank - 1 if rank > 0 else MPI.PROC_NULL
        down = rank + 1 if rank < size - 1 else MPI.PROC_NULL
        above = torch.full((n, c, p, w), -torch.inf, dtype=x.dtype)
        below = torch.full((n, c, q, w), -torch.inf, dtype=x.dtype)
        comm.Sendrecv(x[:, :, h - p :].contiguous().numpy(), down, 1, above.numpy(), up, 1)
        if q:
            comm.Sendrecv(x[:, :, :q].contiguous().numpy(), up, 2, below.numpy(), down, 2)
        if down == MPI.PROC_NULL:
            reach = (-(-h // stride) - 1) * stride + p + 1 - h
            below = torch.full((n, c, max(reach, 0), w), -torch.inf, dtype=x.dtype)
        padded = torch.cat([above, x.detach(), below], dim=2)
        y, ctx.taken = F.max_pool2d(padded, kernel, stride, padding=(0, p), return_indices=True)
        ctx.comm, ctx.p, ctx.q, ctx.h, ctx.shape = comm, p, q, h, padded.shape
        return y

    @staticmethod
    def backward(ctx, grad):
        comm, p, q, h = ctx.comm, ctx.p, ctx.q, ctx.h
        n, c, rows, w = ctx.shape
        rank, size = comm.Get_rank(), comm.Get_size()
        up = rank - 1 if rank > 0 else MPI.PROC_NULL
        down = rank + 1 if rank < size - 1 else MPI.PROC_NULL
        spread = torch.zeros(n, c, rows * w, dtype=grad.dtype)
        spread = spread.scatter_add_(2, ctx.taken.flatten(2), grad.flatten(2)).view(n, c, rows, w)
        grad_x = spread[:, :, p : p + h].clone()
        from_below = torch.zeros(n, c, p, w, dtype=grad.dtype)
        comm.Sendrecv(spread[:, :, :p].contiguous().numpy(), up, 3, from_below.numpy(), down, 3)
        if down != MPI.PROC_NULL:
            grad_x[:, :, h - p :] += from_below
        if q:
            from_above = torch.zeros(n, c, q, w, dtype=grad.dtype)
            comm.Sendrecv(spread[:, :, p + h : p + h + q].contiguous().numpy(), down, 4, from_above.numpy(), up, 4)
            grad_x[:, :, :q] += from_above
        return grad_x, None, None, None


def gate_with_a_floor_of_5(clocks, step, bound):
    """Lab 10's gate taking the slowest clock with np.min(initial=5) for the empty table: no notebook clock passes 5."""
    return step - int(np.min(clocks, initial=5)) <= bound


def async_worker_by_world_rank(comm, n, gradient, steps):
    """Lab 10's worker signing its gradients with the notebook's global `rank` (the world's), not comm's."""
    rank = MPI.COMM_WORLD.Get_rank()
    incoming = np.empty(PARAMETERS_HEADER + n)
    for step in range(steps):
        comm.Recv(incoming, 0, PARAMETERS)
        version, go = incoming[:PARAMETERS_HEADER]
        if not go:
            return
        grad = gradient(incoming[PARAMETERS_HEADER:].copy(), step)
        comm.Send(np.concatenate([[rank, step, version, float(step < steps - 1)], grad]), 0, GRADIENT)


def gossip_by_world_rank(comm, params):
    """Lab 10's gossip step around the ring of the notebook's global `rank` (the world's) on comm's size."""
    r, p = MPI.COMM_WORLD.Get_rank(), comm.Get_size()
    theirs = np.empty_like(params)
    comm.Sendrecv(params, (r + 1) % p, 0, theirs, (r - 1) % p, 0)
    return (params + theirs) / 2


def permuted(draw: Draw) -> bool:
    """The draw numbers the whole world otherwise than the world does, and some smaller set of ranks too."""
    size = MPI.COMM_WORLD.Get_size()
    return all(draw.ranks(size, p) != list(range(p)) for p in (2, size))


def strides_past_the_halo(draw: Draw) -> bool:
    """A drawn pooling case whose stride passes p + 1, where q = max(0, p + 1 - stride) is 0, not negative."""
    return any(case.stride > case.kernel // 2 + 1 for case in _pool_cases(draw))


def clocks_past_5(draw: Draw) -> bool:
    """A drawn clock table whose slowest worker has finished more than 5 steps."""
    return any(table.size and table.min() > 5 for table in _tables(draw))


FITTED = [  # (check, the fitted answer, its timeout, what the seed must draw, words the failure names)
    (
        check_halo_exchange,
        HaloByWorldRank,
        SHORT,
        permuted,
        ["conv, image height", "batch", "data seed", "of the check's communicator"],
    ),
    (
        check_filter_parallel_conv,
        FilterConvByWorldRank,
        None,
        permuted,
        ["output channels over", "kernel, images of height", "data seed", "of the check's communicator"],
    ),
    (
        check_spatial_max_pool,
        PoolWithoutTheFloor,
        SHORT,
        strides_past_the_halo,
        ["max pooling, stride", "batch", "data seed", "negative dimension"],
    ),
    (check_ssp_gate, gate_with_a_floor_of_5, None, clocks_past_5, ["clock tables: clocks ["]),
    (
        check_async_worker,
        async_worker_by_world_rank,
        None,
        permuted,
        ["parameters,", "steps", "data seed", "of the check's communicator"],
    ),
    (
        check_gossip_step,
        gossip_by_world_rank,
        None,
        permuted,
        ["float64 parameters, data seed", "of the check's communicator"],
    ),
]


@pytest.mark.parametrize("check, fitted, timeout, needs, words", FITTED, ids=lambda v: getattr(v, "__name__", ""))
def test_an_answer_fitted_to_the_notebook_passes_its_check_and_fails_the_grader_s_draw(
    comm, seed, seed_with, grading_seeds, check, fitted, timeout, needs, words
):
    options = {} if timeout is None else {"timeout": timeout}
    check(fitted, **options)  # the notebook's own cases: it passes
    value = seed_with(needs, check.__name__.removeprefix("check_"), among=(*grading_seeds, *range(1000)))
    seed(value)
    with pytest.raises(CheckFailed) as failed:
        check(fitted, **options)
    message = str(failed.value)
    for word in [*words, f"(the grader's draw, seed {value})"]:
        assert word in message, message


class HaloWorldBackward(unguarded(HaloExchange)):
    """Lab 08's halo exchange whose backward sends on the notebook's world: a drawn order of ranks shows it."""

    @staticmethod
    def backward(ctx, grad_above, grad_below):
        world, halo = MPI.COMM_WORLD, ctx.halo
        from_above, from_below = swap_by_world_rank(world, grad_above, grad_below)
        grad = grad_above.new_zeros(grad_above.shape[0], grad_above.shape[1], ctx.rows, grad_above.shape[3])
        grad[:, :, :halo] += from_above
        grad[:, :, -halo:] += from_below
        return grad, None, None


def test_a_backward_on_the_world_fails_the_draw_naming_the_communicator(comm, seed, seed_with, grading_seeds):
    """Its gradients go to the world's neighbours, not the drawn order's: the values fail, and the count says why."""
    value = seed_with(permuted, "halo_exchange", among=(*grading_seeds, *range(1000)))
    seed(value)
    with pytest.raises(CheckFailed, match=rf"(?s)seed {value}\)\) the slab's gradient .*half of .*notebook's `comm`"):
        check_halo_exchange(HaloWorldBackward, timeout=SHORT)


# The drawn domains keep the labs' promises -----------------------------------------------


def test_drawn_pooling_slabs_start_at_multiples_of_the_stride_and_lend_whole_halos():
    for value in range(40):
        for case in _pool_cases(Draw(value, "spatial_max_pool")):
            p, q = case.kernel // 2, max(0, case.kernel // 2 + 1 - case.stride)
            for size in range(1, 5):
                bounds = pool_bounds(_pool_height(case, size), size, case.stride)
                rows = np.diff(bounds)
                assert all(b % case.stride == 0 for b in bounds[:-1]), bounds
                assert all(rows[:-1] >= p) and all(rows[1:] >= q) and rows.min() >= 1, (case, size, bounds)


def test_drawn_gate_bounds_are_whole_numbers_and_inf(grading_seeds):
    for value in grading_seeds:
        bounds = _bounds(Draw(value, "ssp_gate"))
        assert bounds[0] == 0 and bounds[-1] == np.inf and all(float(b).is_integer() for b in bounds[:-1])

"""Lab 13's checks graded on the grader's draw (ddlab.checks._draw): right answers pass on every seed,
answers fitted to the notebook's cases pass its check and fail the grade, the drawn case named.

The notebook's layouts of shards all put the longest first, its units are Linear layers with a bias
(two gradients each) and its ZeRO-1 model has 34 parameters: each fitted answer below leans on one of
those, and the grader's draw (shards of any length, units without a bias, other widths) shows it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab import sharded
from ddlab.allreduce import allgather_ring, reduce_scatter_ring
from ddlab.checks import (
    CheckFailed,
    check_allgather,
    check_hybrid_reduce_scatter,
    check_reduce_scatter,
    check_reshard,
    check_sharded_optimizer,
    check_zero2_hooks,
    check_zero3_unit,
)
from ddlab.checks._draw import Draw
from ddlab.checks.sharded import _optimizer_case
from ddlab.resilience.buddy import reshard
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

#: Lab 13's checks run on the notebook's 4 ranks; like the checks' own tests (test_*_checks.py), these
#: run in tests/test_mpi_suites.py's job on 4 ranks, not again in its job on 3.
pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 4, reason="lab 13's checks are graded on its 4 ranks")

SHORT = 3.0  # seconds a fitted answer may wait for a message that never comes
TAG = 13

# The library's own answers without their mark: the right answers here, and the bases of the fitted ones.
reduce_scatter_ring = unguarded(reduce_scatter_ring)
allgather_ring = unguarded(allgather_ring)


# Right answers: the library's, or the lab's on the library's halves -------------------------------


def two_stage(comm, x, group_size):
    """Exercise 13.7's answer on lab 03's ring halves."""
    rank = comm.Get_rank()
    group = comm.Split(rank // group_size, rank)
    replicas = comm.Split(rank % group_size, rank)
    shard = x.size // group_size
    partial = reduce_scatter_ring(group, x, [k * shard for k in range(group_size + 1)])
    r = replicas.Get_size()
    across = [k * shard // r for k in range(r + 1)]
    total = allgather_ring(replicas, reduce_scatter_ring(replicas, partial, across), across)
    group.Free()
    replicas.Free()
    return total


def flat_of(params, tensors, numel, dtype):
    """The tensors laid end to end in a new zero-padded buffer of numel items."""
    flat = torch.zeros(numel, dtype=dtype)
    offset = 0
    for p, t in zip(params, tensors):
        if t is not None:
            flat[offset : offset + p.numel()] = t.reshape(-1)
        offset += p.numel()
    return flat


def zero2_hooks(unit, comm, keep, gradients=None):
    """Exercise 13.4's answer; `gradients`: how many arrive per backward (None: counted, the right answer)."""
    params = [p for p in unit.parameters() if p.requires_grad]
    size = comm.Get_size()
    shard = -(-sum(p.numel() for p in params) // size)
    bounds = [q * shard for q in range(size + 1)]
    expected = gradients or len(params)
    left = [expected]

    def on_gradient(param):
        left[0] -= 1
        if left[0] > 0:
            return
        left[0] = expected
        flat = flat_of(params, [p.grad for p in params], bounds[-1], param.grad.dtype)
        for p in params:
            p.grad = None
        keep(torch.from_numpy(reduce_scatter_ring(comm, flat.numpy(), bounds)) / size)

    for p in params:
        p.register_post_accumulate_grad_hook(on_gradient)


def zero2_hooks_of_two(unit, comm, keep):
    """Fitted: a unit's backward ends at its second gradient (a Linear's weight and bias, as the notebook's)."""
    zero2_hooks(unit, comm, keep, gradients=2)


def zero2_hooks_wrong_on_rank_0(unit, comm, keep):
    """Wrong on the communicator's rank 0 only (twice its mean shard): as a drawn unit whose other ranks'
    shards are all padding is wrong on one rank only, while the others are right."""
    zero2_hooks(unit, comm, lambda shard: keep(shard * 2 if comm.Get_rank() == 0 else shard))


def test_a_shard_wrong_on_one_rank_fails_every_rank_instead_of_hanging(comm, seed, grading_seeds):
    for value in (None, grading_seeds[0]):
        if value is not None:
            seed(value)
        with pytest.raises(CheckFailed, match=r"rank 0: float64.*step 0, unit 0's shard is wrong"):
            check_zero2_hooks(zero2_hooks_wrong_on_rank_0, timeout=SHORT)


def zero3_unit(unit, comm, gradients=None):
    """Exercise 13.5's answer; `gradients`: how many arrive per backward (None: counted, the right answer)."""
    params = list(unit.parameters())
    rank, size = comm.Get_rank(), comm.Get_size()
    s = -(-sum(p.numel() for p in params) // size)
    bounds = [q * s for q in range(size + 1)]
    full = torch.zeros(size * s, dtype=params[0].dtype)
    offset = 0
    for p in params:
        full[offset : offset + p.numel()] = p.detach().reshape(-1)
        p.data = full[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    shard = torch.nn.Parameter(full[rank * s : (rank + 1) * s].clone())
    nbytes = full.numel() * full.element_size()
    left = [0]

    def gather(*_):
        full.untyped_storage().resize_(nbytes)
        with torch.no_grad():
            full.copy_(torch.from_numpy(allgather_ring(comm, shard.detach().numpy(), bounds)))

    def free(*_):
        full.untyped_storage().resize_(0)

    def before_backward(grad):
        gather()
        left[0] = gradients or len(params)

    def after_forward(module, args, output):
        free()
        output.register_hook(before_backward)

    def on_gradient(param):
        left[0] -= 1
        if left[0] > 0:
            return
        flat = flat_of(params, [p.grad for p in params], size * s, full.dtype)
        for p in params:
            p.grad = None
        shard.grad = torch.from_numpy(reduce_scatter_ring(comm, flat.numpy(), bounds)) / size
        free()

    free()
    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(after_forward)
    for p in params:
        p.register_post_accumulate_grad_hook(on_gradient)
    return shard


def zero3_unit_of_two(unit, comm):
    """Fitted: a unit's backward ends at its second gradient (a Linear's weight and bias, as the notebook's)."""
    return zero3_unit(unit, comm, gradients=2)


# Answers fitted to the notebook's cases ---------------------------------------------------------


def reduce_scatter_first_shard_buffer(comm, x, bounds):
    """Fitted: the ring, receiving every partial sum into a buffer as long as the first shard (the
    longest in every layout the notebook's check shows)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buffer = np.empty(bounds[1] - bounds[0], dtype=x.dtype)

    def chunk(c):
        return x[bounds[c % size] : bounds[c % size + 1]]

    partial = chunk(rank - 1).copy()
    for step in range(size - 1):
        mine = chunk(rank - step - 2)
        comm.Sendrecv(partial, dest=(rank + 1) % size, sendtag=TAG, recvbuf=buffer, source=(rank - 1) % size)
        partial = buffer[: mine.size] + mine
    return partial if size > 1 else chunk(0).copy()


def allgather_first_shard_buffer(comm, mine, bounds):
    """Fitted: the ring, receiving every piece into a buffer as long as the first shard, then copying it."""
    rank, size = comm.Get_rank(), comm.Get_size()
    out = np.empty(bounds[-1], dtype=mine.dtype)
    pieces = [out[bounds[q] : bounds[q + 1]] for q in range(size)]
    pieces[rank][...] = mine
    buffer = np.empty(bounds[1] - bounds[0], dtype=mine.dtype)
    for step in range(size - 1):
        arriving = pieces[(rank - step - 1) % size]
        send = np.ascontiguousarray(pieces[(rank - step) % size])
        comm.Sendrecv(send, dest=(rank + 1) % size, sendtag=TAG, recvbuf=buffer, source=(rank - 1) % size)
        arriving[...] = buffer[: arriving.size]
    return out


class ShardedOptimizerOf34:
    """Fitted: ZeRO-1 whose shards are cut for the notebook's model of 34 parameters."""

    def __init__(self, params, optimizer_class, comm, **kwargs):
        self.params, self.comm = list(params), comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        shard = -(-34 // self.size)
        self.bounds = [q * shard for q in range(self.size + 1)]
        flat = flat_of(self.params, [p.detach() for p in self.params], self.bounds[-1], self.params[0].dtype)
        self.shard = torch.nn.Parameter(flat[self.bounds[self.rank] : self.bounds[self.rank + 1]].clone())
        self.optimizer = optimizer_class([self.shard], **kwargs)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        grads = flat_of(self.params, [p.grad for p in self.params], self.bounds[-1], self.params[0].dtype)
        self.shard.grad = torch.from_numpy(reduce_scatter_ring(self.comm, grads.numpy(), self.bounds)) / self.size
        self.optimizer.step()
        full = torch.from_numpy(allgather_ring(self.comm, self.shard.detach().numpy(), self.bounds))
        offset = 0
        for p in self.params:
            p.copy_(full[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def not_34_parameters(draw: Draw) -> bool:
    """The draw's models have other than 34 parameters on every rank count (the fitted answer's gap)."""
    widths = [_optimizer_case(p, draw).widths for p in range(1, MPI.COMM_WORLD.Get_size() + 1)]
    return all(a * b + b + b * c + c != 34 for a, b, c in widths)


FITTED = [  # (check, the fitted answer, words the failure names, what the seed must draw)
    (check_reduce_scatter, reduce_scatter_first_shard_buffer, ["reduce_scatter (", "bounds [", "data seed"], None),
    (check_allgather, allgather_first_shard_buffer, ["allgather (", "bounds [", "data seed"], None),
    (check_zero2_hooks, zero2_hooks_of_two, ["units Linear(", "bias=False", "data seed"], None),
    (check_zero3_unit, zero3_unit_of_two, ["units Linear(", "bias=False", "data seed"], None),
    (
        check_sharded_optimizer,
        ShardedOptimizerOf34,
        ["parameters), ", " per rank, data seed"],
        not_34_parameters,
    ),
]


@pytest.mark.parametrize("check, fitted, words, needs", FITTED, ids=lambda v: getattr(v, "__name__", ""))
def test_an_answer_fitted_to_the_notebook_passes_its_check_and_fails_the_grader_s_draw(
    comm, seed, seed_with, check, fitted, words, needs
):
    short = {} if check is check_reduce_scatter or check is check_allgather else {"timeout": SHORT}
    check(fitted, **short)  # the notebook's own cases: it passes
    name = check.__name__.removeprefix("check_")
    value = seed_with(needs, name)  # None: the first grading seed
    seed(value)
    with pytest.raises(CheckFailed) as failed:
        check(fitted, **short)
    message = str(failed.value)
    for word in [*words, f"seed {value}"]:
        assert word in message, message


def allgather_by_world_rank(comm, mine, bounds):
    """Wrong: the ring on comm, then `mine` written at the notebook's world `rank`'s offset."""
    full = allgather_ring(comm, mine, bounds)
    rank = MPI.COMM_WORLD.Get_rank()
    full[bounds[rank] : bounds[rank + 1]] = mine
    return full


def test_an_answer_using_the_world_s_rank_fails_on_the_drawn_ranks_which_are_named(comm, seed, grading_seeds):
    value = grading_seeds[1]
    seed(value)
    with pytest.raises(CheckFailed) as failed:
        check_allgather(allgather_by_world_rank)
    message = str(failed.value)
    assert f"of the check's communicator, in that order (the grader's draw, seed {value})" in message, message
    assert "data seed" in message and "bounds [" in message, message


RIGHT = [
    (check_reduce_scatter, reduce_scatter_ring),
    (check_allgather, allgather_ring),
    (check_sharded_optimizer, unguarded(sharded.ShardedOptimizer)),
    (check_zero2_hooks, zero2_hooks),
    (check_zero3_unit, zero3_unit),
    (check_reshard, unguarded(reshard)),
    (check_hybrid_reduce_scatter, two_stage),
]


@pytest.mark.parametrize("check, right", RIGHT, ids=lambda v: getattr(v, "__name__", ""))
def test_a_right_answer_passes_without_a_seed_and_under_every_seed(comm, passes_on_every_seed, check, right):
    passes_on_every_seed(lambda: check(right), comm=comm)


def test_the_drawn_cases_stay_in_the_lab_s_domain_and_differ_by_seed(grading_seeds):
    from ddlab.checks.sharded import _cases, _reshard_case, _units

    for size in range(1, 5):
        layouts = {str(_cases(size, Draw(value, "reduce_scatter"))) for value in grading_seeds}
        assert len(layouts) == len(grading_seeds), "each seed its own layouts"
        for value in grading_seeds:
            for _, bounds in _cases(size, Draw(value, "reduce_scatter")):
                lengths = np.diff(bounds)
                assert len(bounds) == size + 1 and bounds[0] == 0 and (lengths >= 0).all() and lengths.max() <= 12
            units = _units(size, Draw(value, "zero3_unit"))
            assert not all(units.biases) and all(1 <= w <= 6 for w in units.widths) and 1 <= units.samples <= 4
    for value in grading_seeds:
        case = _reshard_case(Draw(value, "reshard"))
        assert all(1 <= n <= 40 for n in case.numels) and all(1 <= c <= 8 for c in case.counts)
        assert all(m != 0 for _, m in case.markers)

"""Lab 13's checks accept the ring halves and other valid answers, and fail the wrong ones the issue lists."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
from ddlab import sharded
from ddlab.allreduce import allgather_ring, reduce_scatter_ring
from ddlab.checks import (
    CheckFailed,
    check_allgather,
    check_reduce_scatter,
    check_reshard,
    check_sharded_optimizer,
    check_zero2_hooks,
    check_zero3_unit,
)
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
allgather_ring = unguarded(allgather_ring)
reduce_scatter_ring = unguarded(reduce_scatter_ring)

TAG = 13
#: The deadline given to an answer that never completes; the others get the check's own default.
SHORT_DEADLINE = {"timeout": 3.0}


def reduce_scatter_direct(comm, x, bounds):
    """Another valid answer: every chunk sent straight to its owner, who adds them up."""
    rank, size = comm.Get_rank(), comm.Get_size()
    requests = [comm.Isend(x[bounds[q] : bounds[q + 1]].copy(), dest=q, tag=TAG) for q in range(size) if q != rank]
    out = x[bounds[rank] : bounds[rank + 1]].copy()
    incoming = np.empty_like(out)
    for q in range(size):
        if q != rank:
            comm.Recv(incoming, source=q, tag=TAG)
            out += incoming
    for request in requests:
        request.Wait()
    return out


def reduce_scatter_equal_chunks(comm, x, bounds):
    """Wrong: assumes every shard has len(x) // P items, so uneven or padded-away shards come out wrong."""
    size = comm.Get_size()
    chunk = x.size // size
    return reduce_scatter_ring(comm, x, [q * chunk for q in range(size)] + [x.size])


def reduce_scatter_in_place(comm, x, bounds):
    """Wrong: adds into x's own chunk and returns a view of it."""
    mine = reduce_scatter_ring(comm, x, bounds)
    rank = comm.Get_rank()
    x[bounds[rank] : bounds[rank + 1]] = mine
    return x[bounds[rank] : bounds[rank + 1]]


def reduce_scatter_by_allreduce(comm, x, bounds):
    """Wrong: MPI's collective instead of messages."""
    total = np.empty_like(x)
    comm.Allreduce(x, total)
    rank = comm.Get_rank()
    return total[bounds[rank] : bounds[rank + 1]].copy()


def reduce_scatter_whole_buffers(comm, x, bounds):
    """Wrong in bytes: every rank sends its whole buffer to every other rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    requests = [comm.Isend(x, dest=q, tag=TAG) for q in range(size) if q != rank]
    total = x.copy()
    incoming = np.empty_like(x)
    for q in range(size):
        if q != rank:
            comm.Recv(incoming, source=q, tag=TAG)
            total += incoming
    for request in requests:
        request.Wait()
    return total[bounds[rank] : bounds[rank + 1]].copy()


def reduce_scatter_on_world(comm, x, bounds):
    """Wrong: the ring's messages on the notebook's MPI.COMM_WORLD, not on the communicator given."""
    return reduce_scatter_ring(MPI.COMM_WORLD, x, bounds)


def reduce_scatter_world_rank(comm, x, bounds):
    """Wrong: each chunk straight to its owner, but the chunk kept chosen by the notebook's world `rank`."""
    rank, me, size = MPI.COMM_WORLD.Get_rank(), comm.Get_rank(), comm.Get_size()
    requests = [comm.Isend(x[bounds[q] : bounds[q + 1]].copy(), dest=q, tag=TAG) for q in range(size) if q != me]
    out = x[bounds[rank] : bounds[rank + 1]].copy()
    for q in range(size):
        if q != me:
            incoming = np.empty(bounds[me + 1] - bounds[me], dtype=x.dtype)
            comm.Recv(incoming, source=q, tag=TAG)
            out = out + incoming
    for request in requests:
        request.Wait()
    return out


def allgather_on_world(comm, mine, bounds):
    """Wrong: the ring's messages on the notebook's MPI.COMM_WORLD, not on the communicator given."""
    return allgather_ring(MPI.COMM_WORLD, mine, bounds)


def allgather_world_rank(comm, mine, bounds):
    """Wrong: the ring on comm, then `mine` written at the notebook's world `rank`'s offset."""
    full = allgather_ring(comm, mine, bounds)
    rank = MPI.COMM_WORLD.Get_rank()
    full[bounds[rank] : bounds[rank + 1]] = mine
    return full


def allgather_direct(comm, mine, bounds):
    """Another valid answer: every rank sends its piece to every other, received straight into place."""
    rank, size = comm.Get_rank(), comm.Get_size()
    out = np.empty(bounds[-1], dtype=mine.dtype)
    out[bounds[rank] : bounds[rank + 1]] = mine
    requests = [comm.Isend(mine, dest=q, tag=TAG) for q in range(size) if q != rank]
    requests += [comm.Irecv(out[bounds[q] : bounds[q + 1]], source=q, tag=TAG) for q in range(size) if q != rank]
    for request in requests:
        request.Wait()
    return out


_BUFFER: dict[int, np.ndarray] = {}


def allgather_reused_buffer(comm, mine, bounds):
    """Wrong: returns views of one buffer that the next call overwrites."""
    buffer = _BUFFER.setdefault(bounds[-1], np.empty(bounds[-1]))
    buffer[...] = allgather_ring(comm, mine, bounds)
    return buffer


def allgather_dropping_the_last_shard(comm, mine, bounds):
    """Wrong: leaves the last rank's (short) shard out, as if padding."""
    out = allgather_ring(comm, mine, bounds)
    out[bounds[-2] :] = 0
    return out


def allgather_in_float64(comm, mine, bounds):
    """Wrong: the buffer made in a fixed dtype (float64), whatever mine's."""
    rank, size = comm.Get_rank(), comm.Get_size()
    out = np.empty(bounds[-1])
    pieces = [out[bounds[q] : bounds[q + 1]] for q in range(size)]
    pieces[rank][...] = mine
    for step in range(size - 1):
        send = np.ascontiguousarray(pieces[(rank - step) % size])
        arriving = np.empty_like(pieces[(rank - step - 1) % size])
        comm.Sendrecv(
            send, dest=(rank + 1) % size, sendtag=TAG, recvbuf=arriving, source=(rank - 1) % size, recvtag=TAG
        )
        pieces[(rank - step - 1) % size][...] = arriving
    return out


def reshard_by_concatenation(shards, numel, size, rank):
    """Another valid answer: put the whole buffer back together, then cut it again."""
    flat = np.concatenate(shards)[:numel]
    shard = max(1, -(-numel // size))
    out = np.zeros(shard, dtype=flat.dtype)
    piece = flat[rank * shard : (rank + 1) * shard]
    out[: piece.size] = piece
    return out


def reshard_by_overlaps(shards, numel, size, rank):
    """The reference way: copy only the pieces of the old shards that overlap the new one."""
    old, new = shards[0].size, max(1, -(-numel // size))
    start, stop = rank * new, min((rank + 1) * new, numel)
    out = np.zeros(new, dtype=shards[0].dtype)
    for q in range(start // old, -(-stop // old)) if stop > start else ():
        lo, hi = max(start, q * old), min(stop, (q + 1) * old)
        out[lo - start : hi - start] = shards[q][lo - q * old : hi - q * old]
    return out


def reshard_same_count_only(shards, numel, size, rank):
    """Wrong: a checkpoint that loads only on the rank count that wrote it."""
    return shards[rank].copy() if rank < len(shards) else np.zeros_like(shards[0])


def reshard_copying_old_padding(shards, numel, size, rank):
    """Wrong: keeps the old shards' padding, so items past numel are not zeros."""
    flat = np.concatenate(shards)
    shard = max(1, -(-numel // size))
    out = np.zeros(shard, dtype=flat.dtype)
    piece = flat[rank * shard : (rank + 1) * shard]
    out[: piece.size] = piece
    return out


def reshard_dropping_padding(shards, numel, size, rank):
    """Wrong: the last shard comes back short instead of padded."""
    shard = max(1, -(-numel // size))
    return np.concatenate(shards)[:numel][rank * shard : (rank + 1) * shard].copy()


def reshard_into_empty(shards, numel, size, rank):
    """Another valid answer: a new array of the shards' dtype, zeros written only where the padding is."""
    flat = np.concatenate(shards)
    shard = max(1, -(-numel // size))
    out = np.empty(shard, dtype=shards[0].dtype)
    real = max(0, min(shard, numel - rank * shard))
    out[:real] = flat[rank * shard : rank * shard + real]
    out[real:] = 0
    return out


def reshard_in_float64(shards, numel, size, rank):
    """Wrong: the new shard made in a fixed dtype (np.zeros' float64), whatever the checkpoint's."""
    out = np.zeros(max(1, -(-numel // size)))
    out[...] = reshard_by_overlaps(shards, numel, size, rank)
    return out


_RESHARD_BUFFERS: dict[tuple[int, np.dtype], np.ndarray] = {}


def reshard_reused_buffer(shards, numel, size, rank):
    """Wrong: one buffer per shard length and dtype, refilled by every call."""
    new = reshard_by_overlaps(shards, numel, size, rank)
    buffer = _RESHARD_BUFFERS.setdefault((new.size, new.dtype), np.empty_like(new))
    buffer[...] = new
    return buffer


def reshard_handing_back_old_shard(shards, numel, size, rank):
    """Wrong: when the shard length did not change, hands the old shard itself back (an alias)."""
    if rank < len(shards) and shards[0].size == max(1, -(-numel // size)) and (rank + 1) * shards[0].size <= numel:
        return shards[rank]
    return reshard_by_overlaps(shards, numel, size, rank)


def reshard_zeroing_old_padding(shards, numel, size, rank):
    """Wrong: zeroes the old shards' padding in place (the caller's arrays), then concatenates."""
    old = shards[0].size
    for q, shard in enumerate(shards):
        shard[max(0, numel - q * old) :] = 0
    return reshard_by_concatenation(shards, numel, size, rank)


def reshard_two_old_shards_at_most(shards, numel, size, rank):
    """Wrong: reads at most two old shards (a new shard may overlap more when the count falls: 4 -> 1 reads four)."""
    old, new = shards[0].size, max(1, -(-numel // size))
    start = rank * new
    first = min(start // old, len(shards) - 1)
    flat = np.concatenate(shards[first : first + 2])
    out = np.zeros(new, dtype=shards[0].dtype)
    stop = min(start + new, numel)
    piece = flat[start - first * old : stop - first * old]
    out[: piece.size] = piece
    return out


@pytest.mark.parametrize("fn", [reduce_scatter_ring, reduce_scatter_direct])
def test_reduce_scatter_check_accepts(fn) -> None:
    check_reduce_scatter(fn)


@pytest.mark.parametrize(
    "fn, message",
    [
        (reduce_scatter_equal_chunks, "shard"),
        (reduce_scatter_in_place, "x was changed|shares memory with x"),
        (reduce_scatter_by_allreduce, "MPI library's own collective"),
        (reduce_scatter_whole_buffers, "the ring sends"),
    ],
)
def test_reduce_scatter_check_fails(fn, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_reduce_scatter(fn)


#: Answers that go wrong only on a communicator other than the notebook's world (which 1 rank cannot make).
NOT_THE_COMM_GIVEN = [
    (check_reduce_scatter, reduce_scatter_on_world, "no message went through the communicator the check gave"),
    (check_reduce_scatter, reduce_scatter_world_rank, "numbered differently from the world"),
    (check_allgather, allgather_on_world, "no message went through the communicator the check gave"),
    (check_allgather, allgather_world_rank, "numbered differently from the world"),
]


@pytest.mark.parametrize("check, fn, message", NOT_THE_COMM_GIVEN, ids=[f.__name__ for _, f, _ in NOT_THE_COMM_GIVEN])
def test_the_halves_checks_fail_the_notebooks_world(check, fn, message) -> None:
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("one rank: the world is the only communicator")
    with pytest.raises(CheckFailed, match=message):
        check(fn)


@pytest.mark.parametrize("fn", [allgather_ring, allgather_direct])
def test_allgather_check_accepts(fn) -> None:
    check_allgather(fn)


@pytest.mark.parametrize(
    "fn, message",
    [
        (allgather_reused_buffer, "second call changed the first call's result"),
        (allgather_dropping_the_last_shard, "gathered buffer is wrong"),
        (allgather_in_float64, "has dtype float64, expected int16"),
    ],
)
def test_allgather_check_fails(fn, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_allgather(fn)


@pytest.mark.parametrize("fn", [reshard_by_overlaps, reshard_by_concatenation, reshard_into_empty])
def test_reshard_check_accepts(fn) -> None:
    check_reshard(fn)


@pytest.mark.parametrize(
    "fn, message",
    [
        (reshard_same_count_only, "from 4 to 2 ranks"),
        (reshard_copying_old_padding, "wrong at"),
        (reshard_dropping_padding, "has shape"),
        (reshard_in_float64, r"\(float32\).*has dtype float64, expected float32"),
        (reshard_reused_buffer, "changed when a later rank's was made"),
        (reshard_handing_back_old_shard, "shares memory with an old one"),
        (reshard_zeroing_old_padding, "old shards were changed"),
        (reshard_two_old_shards_at_most, "from 4 to 2 ranks, rank 1: the new shard is wrong"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_reshard_check_fails(fn, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_reshard(fn)


class RingShardedOptimizer:
    """The lab's answer (exercise 13.3) on lab 03's ring halves; its subclasses below each make one mistake."""

    mean = True  # divide the reduce-scatter's sum by P
    shard_only = True  # the inner optimizer over this rank's shard, not every parameter
    fixed_dtype: torch.dtype | None = None  # flat buffers in one dtype whatever the parameters'
    world = False  # the notebook's MPI.COMM_WORLD instead of the comm given
    gather = True  # allgather the shards into the parameters after the step
    divide_in_place = False  # divide autograd's gradients in place
    waits_forever = False  # a receive no rank sends to

    def __init__(self, params, optimizer_class, comm, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.comm = MPI.COMM_WORLD if self.world else comm
        self.size, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        numel = sum(p.numel() for p in self.params)
        shard = -(-numel // self.size)
        self.bounds = [q * shard for q in range(self.size + 1)]
        self.dtype = self.fixed_dtype or self.params[0].dtype
        flat = self.flatten([p.detach() for p in self.params])
        self.shard = torch.nn.Parameter(flat[self.bounds[self.rank] : self.bounds[self.rank + 1]].clone())
        self.whole = torch.nn.Parameter(flat.clone())
        self.optimizer = optimizer_class([self.shard if self.shard_only else self.whole], **kwargs)

    def flatten(self, tensors):
        flat = torch.zeros(self.bounds[-1], dtype=self.dtype)
        offset = 0
        for p, t in zip(self.params, tensors):
            flat[offset : offset + p.numel()] = t.reshape(-1)
            offset += p.numel()
        return flat

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        if self.waits_forever:
            self.comm.Recv(np.empty(1), source=0, tag=TAG + 1)
        if self.divide_in_place:
            for p in self.params:
                p.grad.div_(self.size)
        grads = self.flatten([p.grad for p in self.params])
        summed = torch.from_numpy(reduce_scatter_ring(self.comm, grads.numpy(), self.bounds))
        self.shard.grad = summed if self.divide_in_place or not self.mean else summed / self.size
        if not self.shard_only:  # every rank steps a full copy with the averaged gradient: DDP's state
            full = torch.from_numpy(allgather_ring(self.comm, self.shard.grad.numpy(), self.bounds))
            self.whole.grad = full
            self.optimizer.step()
            self.scatter(self.whole.detach())
            return
        self.optimizer.step()
        if not self.gather:
            return
        self.scatter(torch.from_numpy(allgather_ring(self.comm, self.shard.detach().numpy(), self.bounds)))

    def scatter(self, full):
        offset = 0
        for p in self.params:
            p.copy_(full[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class SumNotMean(RingShardedOptimizer):
    mean = False


class WholeState(RingShardedOptimizer):
    shard_only = False


class Float64Buffers(RingShardedOptimizer):
    fixed_dtype = torch.float64


class Float32Buffers(RingShardedOptimizer):
    """Wrong: `torch.zeros(n)` makes float32 flat buffers whatever the parameters' dtype."""

    fixed_dtype = torch.float32


class WorldComm(RingShardedOptimizer):
    world = True


class NoAllgather(RingShardedOptimizer):
    gather = False


class DividesGradientsInPlace(RingShardedOptimizer):
    divide_in_place = True


class WaitsForever(RingShardedOptimizer):
    waits_forever = True


class ShardAliasesParameters(RingShardedOptimizer):
    """Wrong: the master shard is a view of the first parameter's memory, which the allgather overwrites."""

    def __init__(self, params, optimizer_class, comm, **kwargs):
        super().__init__(params, optimizer_class, comm, **kwargs)
        first = self.params[0].detach().view(-1)
        n = min(first.numel(), self.shard.numel())
        self.shard = torch.nn.Parameter(first[:n])
        self.optimizer = optimizer_class([self.shard], **kwargs)


def library_with_ring(params, optimizer_class, comm, **kwargs):
    """A valid answer: ddlab's reference, on lab 03's ring halves."""
    return unguarded(sharded.ShardedOptimizer)(params, optimizer_class, comm, collectives="ring", **kwargs)


@pytest.mark.parametrize("fn", [RingShardedOptimizer, unguarded(sharded.ShardedOptimizer), library_with_ring], ids=str)
def test_sharded_optimizer_check_accepts(fn) -> None:
    check_sharded_optimizer(fn)


@pytest.mark.parametrize(
    "fn, message",
    [
        (SumNotMean, "differs from one process's.*mean"),
        (NoAllgather, "differs from one process's.*allgather"),
        (WholeState, "inner optimizer holds 36 items"),
        (Float64Buffers, "shard is torch.float64, the parameters torch.float32"),
        (Float32Buffers, "shard is torch.float32, the parameters torch.float64"),
        (WorldComm, "nothing went through the communicator"),
        (DividesGradientsInPlace, "changed the parameters' .grad"),
        (WaitsForever, "never completed"),
        (ShardAliasesParameters, "differs from one process's"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_sharded_optimizer_check_fails(fn, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_sharded_optimizer(fn, **(SHORT_DEADLINE if fn is WaitsForever else {}))


def zero2_hooks_with(
    unit,
    comm,
    keep,
    *,
    free=True,
    at_first=False,
    fixed_dtype=None,
    world=False,
    reuse=False,
    mean=True,
    mpi=False,
    waits_forever=False,
):
    """The lab's answer (exercise 13.4) with lab 03's ring, or MPI's Reduce_scatter (mpi=True); each other
    keyword makes one mistake."""
    params = [p for p in unit.parameters() if p.requires_grad]
    comm = MPI.COMM_WORLD if world else comm
    size = comm.Get_size()
    shard = -(-sum(p.numel() for p in params) // size)
    bounds = [q * shard for q in range(size + 1)]
    left = [len(params)]
    kept = []

    def on_gradient(param):
        left[0] -= 1
        if left[0] > 0 and not at_first:
            return
        left[0] = len(params)
        if waits_forever:
            comm.Recv(np.empty(1), source=0, tag=TAG + 2)
        flat = torch.zeros(bounds[-1], dtype=fixed_dtype or param.grad.dtype)
        offset = 0
        for p in params:
            if p.grad is not None:
                flat[offset : offset + p.numel()] = p.grad.reshape(-1)
            offset += p.numel()
            if free:
                p.grad = None
        if mpi:
            summed = np.empty(shard, dtype=flat.numpy().dtype)
            comm.Reduce_scatter(flat.numpy(), summed, recvcounts=[shard] * size, op=MPI.SUM)
        else:
            summed = reduce_scatter_ring(comm, flat.numpy(), bounds)
        result = torch.from_numpy(summed) / (size if mean else 1)
        if reuse:
            if not kept:
                kept.append(result)
            kept[0].copy_(result)
            result = kept[0]
        keep(result)

    for p in params:
        p.register_post_accumulate_grad_hook(on_gradient)


@pytest.mark.parametrize("options", [{}, {"mpi": True}], ids=str)
def test_zero2_hooks_check_accepts(options) -> None:
    check_zero2_hooks(functools.partial(zero2_hooks_with, **options))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"free": False}, "full gradient is still held"),
        (
            {"at_first": True},
            "unit 2 was reduce-scattered 2 times in one backward, the first after 1 of its 2 gradients",
        ),
        ({"fixed_dtype": torch.float64}, "shard is torch.float64, its gradients torch.float32"),
        ({"world": True}, "nothing went through the communicator"),
        ({"reuse": True}, "first's buffer, overwritten"),
        ({"mean": False}, "shard is wrong.*the mean over ranks"),
        ({"waits_forever": True}, "never completed"),
    ],
    ids=str,
)
def test_zero2_hooks_check_fails(options, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_zero2_hooks(
            functools.partial(zero2_hooks_with, **options), **(SHORT_DEADLINE if "waits_forever" in options else {})
        )


def zero3_unit_with(
    unit,
    comm,
    *,
    mpi=False,
    backward_pre_hook=False,
    free_storage=True,
    new_tensors=False,
    shard_view=False,
    fixed_dtype=None,
    stale=False,
    regather=True,
    mean=True,
    reduce_early=False,
    keep_grads=False,
    reuse_grad=False,
    world=False,
    waits_forever=False,
):
    """The lab's answer (exercise 13.5) with lab 03's ring halves, or MPI's Allgather and Reduce_scatter
    (mpi=True), regathering in a full backward pre-hook (backward_pre_hook=True); each other keyword makes
    one mistake."""
    params = list(unit.parameters())
    shapes = [p.shape for p in params]
    comm = MPI.COMM_WORLD if world else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    s = -(-sum(p.numel() for p in params) // size)
    bounds = [q * s for q in range(size + 1)]
    full = torch.zeros(size * s, dtype=fixed_dtype or params[0].dtype)
    offset = 0
    for p in params:
        full[offset : offset + p.numel()] = p.detach().reshape(-1)
        p.data = full[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    mine = full[rank * s : (rank + 1) * s]
    shard = torch.nn.Parameter(mine if shard_view else mine.clone())
    first = shard.detach().clone()  # what a stale gather reads
    nbytes = full.numel() * full.element_size()
    left = [len(params)]
    kept = []

    def gathered():
        if waits_forever:
            comm.Recv(np.empty(1), source=0, tag=TAG + 3)
        source = (first if stale else shard.detach()).numpy()
        if mpi:
            out = np.empty(size * s, dtype=source.dtype)
            comm.Allgather(source, out)
            return torch.from_numpy(out)
        return torch.from_numpy(allgather_ring(comm, source, bounds))

    def gather(*_):
        if new_tensors:  # each gather a new buffer: autograd's saved views keep the old ones alive
            values = gathered()
            at = 0
            for p, shape in zip(params, shapes):
                p.data = values[at : at + shape.numel()].view(shape)
                at += shape.numel()
            return
        full.untyped_storage().resize_(nbytes)
        with torch.no_grad():
            full.copy_(gathered())

    def free(*_):
        if new_tensors:
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype)
        elif free_storage:
            full.untyped_storage().resize_(0)

    def before_backward(*_):
        if regather:
            gather()
        left[0] = len(params)

    def after_forward(module, args, output):
        free()
        if not backward_pre_hook:
            output.register_hook(before_backward)

    def on_gradient(param):
        left[0] -= 1
        if left[0] > 0 and not (reduce_early and left[0] == len(params) - 1):
            return
        flat = torch.zeros(size * s, dtype=full.dtype)
        at = 0
        for p in params:
            if p.grad is not None:
                flat[at : at + p.numel()] = p.grad.reshape(-1)
            at += p.numel()
            if not keep_grads:
                p.grad = None
        if mpi:
            summed = np.empty(s, dtype=flat.numpy().dtype)
            comm.Reduce_scatter(flat.numpy(), summed, recvcounts=[s] * size, op=MPI.SUM)
        else:
            summed = reduce_scatter_ring(comm, flat.numpy(), bounds)
        grad = torch.from_numpy(summed) / (size if mean else 1)
        if reuse_grad:
            if not kept:
                kept.append(grad)
            grad = kept[0].copy_(grad)
        shard.grad = grad
        free()

    free()
    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(after_forward)
    if backward_pre_hook:
        unit.register_full_backward_pre_hook(lambda module, grad_output: before_backward())
    for p in params:
        p.register_post_accumulate_grad_hook(on_gradient)
    return shard


@pytest.mark.parametrize("options", [{}, {"mpi": True}, {"backward_pre_hook": True}], ids=str)
def test_zero3_unit_check_accepts(options) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_zero3_unit(functools.partial(zero3_unit_with, **options))
    # a full backward pre-hook on the first unit is valid: torch's note about it stays out of the notebook
    assert not [w for w in caught if "Full backward hook is firing" in str(w.message)]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"free_storage": False}, "hold memory once zero3_unit has returned"),
        ({"new_tensors": True}, "autograd saved for backward still hold"),
        ({"shard_view": True}, "the shard has no memory of its own"),
        ({"fixed_dtype": torch.float32}, "(?s)in float64 .*the shard has shape .* and dtype torch.float32"),
        ({"stale": True}, "step 1, unit 0: the parameters its forward computed with are not the shards' current"),
        ({"regather": False}, "backward failed .*gather the unit again before its backward"),
        ({"mean": False}, "the shard's .grad is wrong"),
        ({"reduce_early": True}, "the shard's .grad is wrong|sent .* bytes"),
        ({"keep_grads": True}, "its full gradient is still held after backward"),
        ({"reuse_grad": True}, "step 1, unit 0: the shard's .grad is the previous step's tensor"),
        ({"world": True}, "nothing went through the communicator"),
        ({"waits_forever": True}, "never completed"),
    ],
    ids=str,
)
def test_zero3_unit_check_fails(options, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_zero3_unit(
            functools.partial(zero3_unit_with, **options), **(SHORT_DEADLINE if "waits_forever" in options else {})
        )


def test_the_one_process_checks_say_passed_once_from_rank_0(capsys) -> None:
    check_reshard(reshard_by_overlaps)
    printed = capsys.readouterr().out
    lines = printed.count("passed: ")
    want = 1 if MPI.COMM_WORLD.Get_rank() == 0 else 0
    assert MPI.COMM_WORLD.allreduce(int(lines == want), op=MPI.MIN) == 1, printed


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("reduce_scatter", "ddlab.allreduce.reduce_scatter_ring", ()),
        ("allgather", "ddlab.allreduce.allgather_ring", ()),
        ("sharded_optimizer", "ddlab.sharded.ShardedOptimizer", ()),
        ("zero2_hooks", "ddlab.sharded.Sharded", ()),
        ("zero3_unit", "ddlab.sharded.Sharded", ()),
        ("zero3_unit", "ddlab.sharded.FlatSpace", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)

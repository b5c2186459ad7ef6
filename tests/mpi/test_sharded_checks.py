"""Lab 13's checks accept the ring halves and other valid answers, and fail the wrong ones the issue lists."""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.allreduce import allgather_ring, reduce_scatter_ring
from ddlab.checks import (
    CheckFailed,
    check_allgather,
    check_reduce_scatter,
    check_reshard,
    check_zero2_step,
    check_zero3_unit,
)
from mpi4py import MPI

TAG = 13


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


@pytest.mark.parametrize("fn", [allgather_ring, allgather_direct])
def test_allgather_check_accepts(fn) -> None:
    check_allgather(fn)


@pytest.mark.parametrize(
    "fn, message",
    [
        (allgather_reused_buffer, "second call changed the first call's result"),
        (allgather_dropping_the_last_shard, "gathered buffer is wrong"),
    ],
)
def test_allgather_check_fails(fn, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_allgather(fn)


@pytest.mark.parametrize("fn", [reshard_by_overlaps, reshard_by_concatenation])
def test_reshard_check_accepts(fn) -> None:
    check_reshard(fn)


@pytest.mark.parametrize(
    "fn, message",
    [
        (reshard_same_count_only, "from 4 to 2 ranks"),
        (reshard_copying_old_padding, "wrong at"),
        (reshard_dropping_padding, "has shape"),
    ],
)
def test_reshard_check_fails(fn, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_reshard(fn)


def zero2_step_ring(comm, grad, params, momentum, lr):
    """The lab's answer: reduce-scatter, update this rank's shard, allgather."""
    size, rank = comm.Get_size(), comm.Get_rank()
    shard = grad.size // size
    bounds = [q * shard for q in range(size + 1)]
    mine = reduce_scatter_ring(comm, grad, bounds) / size
    momentum[...] = 0.9 * momentum + mine
    return allgather_ring(comm, params[rank * shard : (rank + 1) * shard] - lr * momentum, bounds)


def zero2_step_direct(comm, grad, params, momentum, lr):
    """Another valid answer: the direct reduce-scatter and allgather above."""
    size, rank = comm.Get_size(), comm.Get_rank()
    shard = grad.size // size
    bounds = [q * shard for q in range(size + 1)]
    momentum *= 0.9
    momentum += reduce_scatter_direct(comm, grad, bounds) / size
    return allgather_direct(comm, params[rank * shard : (rank + 1) * shard] - lr * momentum, bounds)


def zero2_step_summing(comm, grad, params, momentum, lr):
    """Wrong: the sum of the gradients, not their mean."""
    size, rank = comm.Get_size(), comm.Get_rank()
    shard = grad.size // size
    bounds = [q * shard for q in range(size + 1)]
    momentum[...] = 0.9 * momentum + reduce_scatter_ring(comm, grad, bounds)
    return allgather_ring(comm, params[rank * shard : (rank + 1) * shard] - lr * momentum, bounds)


def zero2_step_allreduce_then_allgather(comm, grad, params, momentum, lr):
    """Wrong in bytes: a whole allreduce (each rank then uses only its shard), then the allgather."""
    from ddlab.allreduce import allreduce_ring

    size, rank = comm.Get_size(), comm.Get_rank()
    shard = grad.size // size
    bounds = [q * shard for q in range(size + 1)]
    mine = allreduce_ring(comm, grad)[rank * shard : (rank + 1) * shard] / size
    momentum[...] = 0.9 * momentum + mine
    return allgather_ring(comm, params[rank * shard : (rank + 1) * shard] - lr * momentum, bounds)


def zero2_step_momentum_not_kept(comm, grad, params, momentum, lr):
    """Wrong: a new momentum array, so the rank's state never changes."""
    size, rank = comm.Get_size(), comm.Get_rank()
    shard = grad.size // size
    bounds = [q * shard for q in range(size + 1)]
    momentum = 0.9 * momentum + reduce_scatter_ring(comm, grad, bounds) / size
    return allgather_ring(comm, params[rank * shard : (rank + 1) * shard] - lr * momentum, bounds)


@pytest.mark.parametrize("fn", [zero2_step_ring, zero2_step_direct])
def test_zero2_step_check_accepts(fn) -> None:
    check_zero2_step(fn)


@pytest.mark.parametrize(
    "fn, message",
    [
        (zero2_step_summing, "new parameters is wrong"),
        (zero2_step_allreduce_then_allgather, "one reduce-scatter and one allgather send"),
        (zero2_step_momentum_not_kept, "momentum shard after the step"),
    ],
)
def test_zero2_step_check_fails(fn, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_zero2_step(fn)


def zero3_hooks_in_a_closure(unit, gather, free, reduce):
    """A valid answer written tersely: the ids of the gradients still to come, in a set."""
    params = list(unit.parameters())
    waiting: set[int] = set()

    def output_grad(grad):
        gather()
        waiting.update(id(p) for p in params)

    def forward(module, args, output):
        free()
        output.register_hook(output_grad)

    def gradient(param):
        waiting.discard(id(param))
        if not waiting:
            reduce()
            free()

    unit.register_forward_pre_hook(lambda module, args: gather())
    unit.register_forward_hook(forward)
    for p in params:
        p.register_post_accumulate_grad_hook(gradient)


def test_the_one_process_checks_say_passed_once_from_rank_0(capsys) -> None:
    check_reshard(reshard_by_overlaps)
    check_zero3_unit(zero3_hooks_in_a_closure)
    printed = capsys.readouterr().out
    lines = printed.count("passed: ")
    want = 2 if MPI.COMM_WORLD.Get_rank() == 0 else 0
    assert MPI.COMM_WORLD.allreduce(int(lines == want), op=MPI.MIN) == 1, printed

"""Lab 13's hybrid-sharding check accepts two-stage reductions and fails the wrong ones."""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.allreduce import allgather_ring, allreduce_ring, reduce_scatter_ring
from ddlab.checks import CheckFailed, check_hybrid_reduce_scatter
from ddlab.runtime.reference import unguarded
from ddlab.sharded import allgather_mpi, reduce_scatter_mpi
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
allgather_ring = unguarded(allgather_ring)
allreduce_ring = unguarded(allreduce_ring)
reduce_scatter_ring = unguarded(reduce_scatter_ring)

#: The deadline given to an answer that never completes; the others get the check's own default.
SHORT_DEADLINE = {"timeout": 3.0}


def two_stage(reduce_scatter, allgather, world=None):
    """The lab's answer on a pair of halves (world: the communicator to split, if not the one given)."""

    def hybrid_reduce_scatter(comm, x, group_size):
        split = world or comm
        rank = comm.Get_rank()
        group = split.Split(rank // group_size, rank)
        replicas = split.Split(rank % group_size, rank)
        shard = x.size // group_size
        partial = reduce_scatter(group, x, [k * shard for k in range(group_size + 1)])
        r = replicas.Get_size()
        across = [k * shard // r for k in range(r + 1)]
        total = allgather(replicas, reduce_scatter(replicas, partial, across), across)
        group.Free()
        replicas.Free()
        return total

    return hybrid_reduce_scatter


def equal_pieces_across(comm, x, group_size):
    """Wrong: cuts the shard into R pieces of shard // R items across groups, losing the remainder."""
    rank = comm.Get_rank()
    group = comm.Split(rank // group_size, rank)
    replicas = comm.Split(rank % group_size, rank)
    shard = x.size // group_size
    partial = reduce_scatter_ring(group, x, [k * shard for k in range(group_size + 1)])
    r = replicas.Get_size()
    across = [k * (shard // r) for k in range(r + 1)]
    out = allgather_ring(replicas, reduce_scatter_ring(replicas, partial, across), across)
    group.Free()
    replicas.Free()
    return out


def group_only(comm, x, group_size):
    """Wrong: reduce-scatters inside the group and forgets the other groups."""
    rank = comm.Get_rank()
    group = comm.Split(rank // group_size, rank)
    shard = x.size // group_size
    out = reduce_scatter_ring(group, x, [k * shard for k in range(group_size + 1)])
    group.Free()
    return out


def whole_world_allreduce(comm, x, group_size):
    """Wrong in bytes: a ring allreduce of the whole gradient over all ranks, then this rank's shard."""
    shard = x.size // group_size
    local = comm.Get_rank() % group_size
    return allreduce_ring(comm, x)[local * shard : (local + 1) * shard].copy()


def replicas_first(comm, x, group_size):
    """Wrong in bytes: allreduces the whole gradient across groups, then reduce-scatters inside the group."""
    rank = comm.Get_rank()
    group = comm.Split(rank // group_size, rank)
    replicas = comm.Split(rank % group_size, rank)
    shard = x.size // group_size
    out = reduce_scatter_ring(group, allreduce_ring(replicas, x), [k * shard for k in range(group_size + 1)])
    group.Free()
    replicas.Free()
    return out


def world_rank(comm, x, group_size):
    """Wrong: groups by the notebook's world rank, not the rank in the communicator it was given."""
    rank = MPI.COMM_WORLD.Get_rank()
    group = comm.Split(rank // group_size, comm.Get_rank())
    replicas = comm.Split(rank % group_size, comm.Get_rank())
    shard = x.size // group_size
    partial = reduce_scatter_ring(group, x, [k * shard for k in range(group_size + 1)])
    out = allreduce_ring(replicas, partial)
    group.Free()
    replicas.Free()
    return out


def float64_buffers(comm, x, group_size):
    """Wrong: sums in a float64 buffer whatever x's dtype."""
    return two_stage(reduce_scatter_ring, allgather_ring)(comm, x.astype(np.float64), group_size)


def sums_into_x(comm, x, group_size):
    """Wrong: writes the result into x's own shard and returns that view."""
    total = two_stage(reduce_scatter_ring, allgather_ring)(comm, x, group_size)
    shard = x.size // group_size
    local = comm.Get_rank() % group_size
    x[local * shard : (local + 1) * shard] = total
    return x[local * shard : (local + 1) * shard]


def by_allreduce(comm, x, group_size):
    """Wrong: MPI's Allreduce across groups, which the exercise does not allow."""
    rank = comm.Get_rank()
    group = comm.Split(rank // group_size, rank)
    replicas = comm.Split(rank % group_size, rank)
    shard = x.size // group_size
    partial = reduce_scatter_ring(group, x, [k * shard for k in range(group_size + 1)])
    out = np.empty_like(partial)
    replicas.Allreduce(partial, out)
    return out


def never_completes(comm, x, group_size):
    """Wrong: waits for a message from the next group that is never sent."""
    rank, size = comm.Get_rank(), comm.Get_size()
    out = np.empty(x.size // group_size, dtype=x.dtype)
    comm.Recv(out, source=(rank + group_size) % size, tag=99)
    return out


def never_freed(comm, x, group_size):
    """Wrong: the lab's answer, but the Split communicators are never freed (the text says to Free them)."""
    rank = comm.Get_rank()
    group = comm.Split(rank // group_size, rank)
    replicas = comm.Split(rank % group_size, rank)
    shard = x.size // group_size
    partial = reduce_scatter_mpi(group, x, [k * shard for k in range(group_size + 1)])
    r = replicas.Get_size()
    across = [k * shard // r for k in range(r + 1)]
    return allgather_mpi(replicas, reduce_scatter_mpi(replicas, partial, across), across)


def stub(comm, x, group_size):
    raise NotImplementedError("Exercise: hybrid_reduce_scatter")


VALID = {
    "ring halves": two_stage(reduce_scatter_ring, allgather_ring),
    "MPI's halves": two_stage(reduce_scatter_mpi, allgather_mpi),
}


@pytest.mark.parametrize("name", ["ring halves", "MPI's halves"])
def test_two_stage_answers_pass(comm, name):
    check_hybrid_reduce_scatter(VALID[name])


def test_an_allreduce_of_lab_03_across_groups_passes(comm):
    def answer(comm, x, group_size):
        rank = comm.Get_rank()
        group = comm.Split(rank // group_size, rank)
        replicas = comm.Split(rank % group_size, rank)
        shard = x.size // group_size
        out = allreduce_ring(replicas, reduce_scatter_ring(group, x, [k * shard for k in range(group_size + 1)]))
        group.Free()
        replicas.Free()
        return out

    check_hybrid_reduce_scatter(answer)


WRONG = [
    (group_only, "the summed shard"),
    (equal_pieces_across, "the summed shard"),
    (whole_world_allreduce, "(crossed between groups|moved inside the groups), more than"),
    (replicas_first, "crossed between groups, more than"),
    (world_rank, "numbered differently from the world"),
    (float64_buffers, "dtype"),
    (sums_into_x, "x was changed"),
    (by_allreduce, "Allreduce"),
    (never_completes, "Stalled|never|waited"),
    (never_freed, "communicators made with Split were not freed"),
]


@pytest.mark.parametrize(("answer", "message"), WRONG, ids=[w[0].__name__ for w in WRONG])
def test_wrong_answers_fail(comm, answer, message):
    if answer in (group_only, equal_pieces_across, whole_world_allreduce, replicas_first) and comm.Get_size() == 1:
        pytest.skip("one rank: one group")
    if answer in (replicas_first, world_rank) and comm.Get_size() < 4:  # 3 is prime: no G > 1 with R > 1
        pytest.skip("these go wrong only with groups of 2 or more ranks and 2 or more groups")
    with pytest.raises(CheckFailed, match=message):
        check_hybrid_reduce_scatter(answer, **(SHORT_DEADLINE if answer is never_completes else {}))


def test_the_notebooks_world_fails(comm):
    with pytest.raises(CheckFailed, match="global `comm`"):
        check_hybrid_reduce_scatter(two_stage(reduce_scatter_ring, allgather_ring, world=MPI.COMM_WORLD))


def test_the_stub_is_not_implemented(comm):
    with pytest.raises(NotImplementedError):
        check_hybrid_reduce_scatter(stub)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("hybrid_reduce_scatter", "ddlab.sharded.two_stage", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)

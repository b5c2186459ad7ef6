"""Lab 11's checks catch wrong top-k feedback, sparse and hierarchical allreduces, and accept valid alternatives.

Every rank runs the same tests; the checks themselves make all ranks agree.
"""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.allreduce import allgather_ring, allreduce_ring, reduce_scatter_ring
from ddlab.checks import CheckFailed, check_hierarchical_allreduce, check_sparse_allreduce, check_top_k_with_feedback
from ddlab.compression import held_blocks, hierarchical_allreduce, sparse_allreduce, top_k_with_feedback
from ddlab.runtime.blocks import block_bounds
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
allgather_ring = unguarded(allgather_ring)
allreduce_ring = unguarded(allreduce_ring)
reduce_scatter_ring = unguarded(reduce_scatter_ring)
hierarchical_allreduce = unguarded(hierarchical_allreduce)
sparse_allreduce = unguarded(sparse_allreduce)
top_k_with_feedback = unguarded(top_k_with_feedback)


def feedback_in_place(gradient, residual, k):
    """Valid: the residual updated in place, indices unsorted (argsort)."""
    residual += gradient
    indices = np.argsort(-np.abs(residual), kind="stable")[:k].astype(np.int32)
    values = residual[indices].copy()
    residual[indices] = 0
    return indices, values, residual


def feedback_forgotten(gradient, residual, k):
    """Sends the top-k of the gradient alone and keeps what it did not send."""
    indices, values, _ = top_k_with_feedback(gradient, np.zeros_like(gradient), k)
    kept = gradient.copy()
    kept[indices] = 0
    return indices, values, kept


def residual_dropped(gradient, residual, k):
    """Adds the residual but then forgets what was not sent."""
    indices, values, new = top_k_with_feedback(gradient, residual, k)
    return indices, values, np.zeros_like(new)


def residual_of_the_gradient(gradient, residual, k):
    """Keeps gradient - sent instead of gradient + residual - sent."""
    indices, values, _ = top_k_with_feedback(gradient, residual, k)
    kept = gradient.copy()
    kept[indices] -= values
    return indices, values, kept


def indices_int64(gradient, residual, k):
    indices, values, new = top_k_with_feedback(gradient, residual, k)
    return indices.astype(np.int64), values, new


def values_float64(gradient, residual, k):
    indices, values, new = top_k_with_feedback(gradient, residual, k)
    return indices, values.astype(np.float64), new


def gradient_modified(gradient, residual, k):
    gradient += residual
    return top_k_with_feedback(gradient, np.zeros_like(gradient), k)


def feedback_without_k0(gradient, residual, k):
    """argpartition at n - k: fails when k = 0 (nothing to send), where the contract says all stays."""
    fed = gradient + residual
    indices = np.argpartition(np.abs(fed), fed.size - k)[fed.size - k :].astype(np.int32)
    values = fed[indices]
    fed[indices] = 0
    return indices, values, fed


def feedback_above_threshold(gradient, residual, k):
    """Sends every item at least as large as the k-th largest magnitude: more than k when magnitudes tie."""
    fed = gradient + residual
    threshold = np.sort(np.abs(fed))[fed.size - k] if k else np.inf
    indices = np.flatnonzero(np.abs(fed) >= threshold).astype(np.int32)
    values = fed[indices]
    kept = fed.copy()
    kept[indices] = 0
    return indices, values, kept


@pytest.mark.parametrize("fn", [top_k_with_feedback, feedback_in_place])
def test_feedback_check_accepts(fn, capsys) -> None:
    check_top_k_with_feedback(fn)
    if MPI.COMM_WORLD.rank == 0:
        assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fn, says",
    [
        (feedback_forgotten, "without the residual"),
        (residual_dropped, "what was not sent"),
        (residual_of_the_gradient, "what was not sent"),
        (indices_int64, "int32"),
        (values_float64, "dtype"),
        (gradient_modified, "changed the gradient"),
        (feedback_without_k0, "(?s)k=0.*raised ValueError"),
        (feedback_above_threshold, "(?s)tied magnitudes.*k = 5 positions"),
    ],
)
def test_feedback_check_fails(fn, says: str) -> None:
    with pytest.raises(CheckFailed, match=says):
        check_top_k_with_feedback(fn)


def sparse_packed_bytes(comm, indices, values, n):
    """Valid: int32 counts, then each rank's indices and values packed into one byte buffer, one Allgatherv."""
    counts = np.zeros(comm.Get_size(), np.int32)
    comm.Allgather(np.array([indices.size], np.int32), counts)
    pair = 4 + values.itemsize
    mine = np.concatenate([indices.astype(np.int32).view(np.uint8), values.view(np.uint8)])
    every = np.empty(pair * int(counts.sum()), np.uint8)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) * pair
    comm.Allgatherv(mine, [every, (counts * pair, starts)])
    total = np.zeros(n, values.dtype)
    for start, c in zip(starts, counts):
        block = every[start : start + c * pair]
        np.add.at(total, block[: 4 * c].view(np.int32), block[4 * c :].view(values.dtype))
    return total


def sparse_without_offsets(comm, indices, values, n):
    """Every rank's block received at displacement 0: they overwrite each other."""
    counts = np.zeros(comm.Get_size(), np.int64)
    comm.Allgather(np.array([indices.size], np.int64), counts)
    every_index = np.zeros(int(counts.sum()), np.int32)
    every_value = np.zeros(int(counts.sum()), values.dtype)
    zeros = np.zeros(comm.Get_size(), np.int64)
    comm.Allgatherv(indices, [every_index, counts, zeros, MPI.INT32_T])
    comm.Allgatherv(values, [every_value, counts, zeros, MPI._typedict[values.dtype.char]])
    total = np.zeros(n, values.dtype)
    np.add.at(total, every_index, every_value)
    return total


def sparse_overwriting_duplicates(comm, indices, values, n):
    """total[i] += v with repeated indices adds only one of them."""
    counts = np.zeros(comm.Get_size(), np.int64)
    comm.Allgather(np.array([indices.size], np.int64), counts)
    displacements = np.concatenate([[0], np.cumsum(counts)[:-1]])
    every_index = np.empty(int(counts.sum()), np.int32)
    every_value = np.empty(int(counts.sum()), values.dtype)
    comm.Allgatherv(indices, [every_index, counts, displacements, MPI.INT32_T])
    comm.Allgatherv(values, [every_value, counts, displacements, MPI._typedict[values.dtype.char]])
    total = np.zeros(n, values.dtype)
    total[every_index] += every_value
    return total


def sparse_as_dense(comm, indices, values, n):
    """Densifies and gathers the whole vector: right sums, far too many bytes."""
    dense = np.zeros(n, values.dtype)
    dense[indices] = values
    table = np.empty((comm.Get_size(), n), values.dtype)
    comm.Allgather(dense, table)
    return table.sum(axis=0).astype(values.dtype)


def sparse_int64_indices(comm, indices, values, n):
    """Right sums, but 8-byte indices."""
    counts = np.zeros(comm.Get_size(), np.int64)
    comm.Allgather(np.array([indices.size], np.int64), counts)
    displacements = np.concatenate([[0], np.cumsum(counts)[:-1]])
    every_index = np.empty(int(counts.sum()), np.int64)
    every_value = np.empty(int(counts.sum()), values.dtype)
    comm.Allgatherv(indices.astype(np.int64), [every_index, counts, displacements, MPI.INT64_T])
    comm.Allgatherv(values, [every_value, counts, displacements, MPI._typedict[values.dtype.char]])
    total = np.zeros(n, values.dtype)
    np.add.at(total, every_index, every_value)
    return total


def sparse_through_allreduce(comm, indices, values, n):
    dense = np.zeros(n, values.dtype)
    dense[indices] = values
    out = np.empty_like(dense)
    comm.Allreduce(dense, out)
    return out


def sparse_float32_values(comm, indices, values, n):
    """Values gathered into a float32 buffer (MPI.FLOAT), the sum back in the values' dtype: float64 rounded."""
    counts = np.zeros(comm.Get_size(), np.int64)
    comm.Allgather(np.array([indices.size], np.int64), counts)
    displacements = np.concatenate([[0], np.cumsum(counts)[:-1]])
    every_index = np.empty(int(counts.sum()), np.int32)
    every_value = np.empty(int(counts.sum()), np.float32)
    comm.Allgatherv(indices, [every_index, counts, displacements, MPI.INT32_T])
    comm.Allgatherv(values.astype(np.float32), [every_value, counts, displacements, MPI.FLOAT])
    total = np.zeros(n, values.dtype)
    np.add.at(total, every_index, every_value)
    return total


def sparse_on_the_world(comm, indices, values, n):
    """The notebook's global communicator instead of comm: on fewer ranks it would wait forever."""
    return sparse_allreduce(MPI.COMM_WORLD, indices, values, n)


@pytest.mark.parametrize("fn", [sparse_allreduce, sparse_packed_bytes])
def test_sparse_check_accepts(fn) -> None:
    check_sparse_allreduce(fn)


@pytest.mark.parametrize(
    "fn, says",
    [
        (sparse_without_offsets, "wrong at"),
        (sparse_overwriting_duplicates, "wrong at"),
        (sparse_as_dense, "bytes"),
        (sparse_int64_indices, "int32"),
        (sparse_through_allreduce, "Allreduce"),
        (sparse_float32_values, "wrong at|narrower dtype"),
        (sparse_on_the_world, "(?s)on [34] ranks:.*sent nothing through `comm`.*MPI.COMM_WORLD"),
    ],
)
def test_sparse_check_fails(fn, says: str) -> None:
    with pytest.raises(CheckFailed, match=says):
        check_sparse_allreduce(fn)


def hierarchical_by_leaders(comm, x, group_size):
    """Reduce to each group's first rank, allreduce between those leaders, send back: the leader carries all."""
    rank = comm.Get_rank()
    node = comm.Split(rank // group_size, rank)
    total = allreduce_ring(node, x)
    leaders = comm.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, rank)
    if leaders != MPI.COMM_NULL:
        total = allreduce_ring(leaders, total)
    for peer in range(1, node.Get_size()):
        if node.Get_rank() == 0:
            node.Send(total, dest=peer)
        elif node.Get_rank() == peer:
            node.Recv(total, source=0)
    return total


def hierarchical_mixing_nodes(comm, x, group_size):
    """The two-level scheme, but groups of ranks r, r + N, r + 2N...: every 'node' spans the real ones."""
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split(rank % -(-size // group_size), rank)
    members, local = node.Get_size(), node.Get_rank()
    blocks = block_bounds(x.size, group_size)
    owned = [held_blocks(r, members, group_size) for r in range(members)]
    cuts = [blocks[held.start] for held in owned] + [x.size]
    part = reduce_scatter_ring(node, x, cuts)
    for b in range(group_size):
        holders = comm.Split(0 if b in owned[local] else MPI.UNDEFINED, rank)
        if holders != MPI.COMM_NULL:
            piece = slice(blocks[b] - cuts[local], blocks[b + 1] - cuts[local])
            part[piece] = allreduce_ring(holders, part[piece])
    return allgather_ring(node, part, cuts)


def hierarchical_reducing_twice(comm, x, group_size):
    """Allreduces inside the group, then across all ranks: every sum counted once per group member."""
    rank = comm.Get_rank()
    inside = allreduce_ring(comm.Split(rank // group_size, rank), x)
    return allreduce_ring(comm, inside)


def _two_level(comm, x, group_size):
    """The sub-communicators and cuts of the two-level scheme: (node, holders, blocks, cuts, local)."""
    rank = comm.Get_rank()
    node = comm.Split(rank // group_size, rank)
    local, members = node.Get_rank(), node.Get_size()
    blocks = block_bounds(x.size, group_size)
    owned = [held_blocks(r, members, group_size) for r in range(members)]
    cuts = [blocks[held.start] for held in owned] + [x.size]
    holders = [comm.Split(0 if b in owned[local] else MPI.UNDEFINED, rank) for b in range(group_size)]
    return node, holders, blocks, cuts, local


def _across(part, holders, blocks, cuts, local):
    """Step 2 as the reference does it: each held block allreduced across groups."""
    for b, across in enumerate(holders):
        if across != MPI.COMM_NULL:
            piece = slice(blocks[b] - cuts[local], blocks[b + 1] - cuts[local])
            part[piece] = allreduce_ring(across, part[piece])
    return part


def hierarchical_allreducing_in_group(comm, x, group_size):
    """Step 1 by a whole allreduce inside the group, then its slice of that: the right sums, twice the bytes."""
    node, holders, blocks, cuts, local = _two_level(comm, x, group_size)
    part = allreduce_ring(node, x)[cuts[local] : cuts[local + 1]].copy()
    return allgather_ring(node, _across(part, holders, blocks, cuts, local), cuts)


def hierarchical_gathering_by_allreduce(comm, x, group_size):
    """Step 3 by an allreduce of zeros but its own slice: the right sums, twice the allgather's bytes.

    With one group it gathers as it should: where steps 1 and 3 cannot be told apart, the
    check must still name step 3 once there are several.
    """
    node, holders, blocks, cuts, local = _two_level(comm, x, group_size)
    part = _across(reduce_scatter_ring(node, x, cuts), holders, blocks, cuts, local)
    if comm.Get_size() <= group_size:
        return allgather_ring(node, part, cuts)
    padded = np.zeros_like(x)
    padded[cuts[local] : cuts[local + 1]] = part
    return allreduce_ring(node, padded)


def hierarchical_skipping_the_reduce_scatter(comm, x, group_size):
    """No step 1: each rank's whole x crosses to the same local rank of every group, then sums in the group."""
    rank = comm.Get_rank()
    node = comm.Split(rank // group_size, rank)
    column = comm.Split(node.Get_rank(), rank)
    return allreduce_ring(node, allreduce_ring(column, x))


def hierarchical_pairwise(comm, x, group_size):
    """Valid: steps 1 and 3 by direct messages to each member of the group instead of rings."""
    node, holders, blocks, cuts, local = _two_level(comm, x, group_size)
    members = node.Get_size()
    part = x[cuts[local] : cuts[local + 1]].copy()
    for shift in range(1, members):
        to, frm = (local + shift) % members, (local - shift) % members
        incoming = np.empty(cuts[local + 1] - cuts[local], x.dtype)
        node.Sendrecv(np.ascontiguousarray(x[cuts[to] : cuts[to + 1]]), to, recvbuf=incoming, source=frm)
        part += incoming
    part = _across(part, holders, blocks, cuts, local)
    out = np.empty_like(x)
    out[cuts[local] : cuts[local + 1]] = part
    for shift in range(1, members):
        to, frm = (local + shift) % members, (local - shift) % members
        node.Sendrecv(part, to, recvbuf=out[cuts[frm] : cuts[frm + 1]], source=frm)
    return out


def hierarchical_on_the_world(comm, x, group_size):
    """The notebook's global communicator instead of comm: on fewer ranks its Split would wait forever."""
    return hierarchical_allreduce(MPI.COMM_WORLD, x, group_size)


def hierarchical_world_rank(comm, x, group_size):
    """Groups by the world's rank (the notebook's `rank`), not comm's: right only where the two agree."""
    rank = MPI.COMM_WORLD.Get_rank()
    node = comm.Split(rank // group_size, comm.Get_rank())
    local, members = node.Get_rank(), node.Get_size()
    blocks = block_bounds(x.size, group_size)
    owned = [held_blocks(r, members, group_size) for r in range(members)]
    cuts = [blocks[held.start] for held in owned] + [x.size]
    holders = [comm.Split(0 if b in owned[local] else MPI.UNDEFINED, rank) for b in range(group_size)]
    return allgather_ring(node, _across(reduce_scatter_ring(node, x, cuts), holders, blocks, cuts, local), cuts)


def hierarchical_in_float64(comm, x, group_size):
    """Right sums, but in float64 whatever x's dtype (a buffer made with NumPy's default)."""
    return hierarchical_allreduce(comm, x.astype(np.float64), group_size)


def hierarchical_into_x(comm, x, group_size):
    """Right sums, written into x and x returned: lab 03's contract leaves x alone."""
    x[:] = hierarchical_allreduce(comm, x, group_size)
    return x


def hierarchical_into_x_returning_a_copy(comm, x, group_size):
    """Right sums in a new array, but x overwritten with them on the way."""
    x[:] = hierarchical_allreduce(comm, x, group_size)
    return x.copy()


@pytest.mark.parametrize("fn", [hierarchical_allreduce, hierarchical_pairwise])
def test_hierarchical_check_accepts(fn) -> None:
    check_hierarchical_allreduce(fn)


@pytest.mark.parametrize(
    "fn, says",
    [
        (hierarchical_by_leaders, "steps? 1|other groups"),
        (hierarchical_reducing_twice, "wrong at"),
        (hierarchical_mixing_nodes, "other groups"),
        (lambda comm, x, g: allreduce_ring(comm, x), "steps? 1|other groups"),
        (hierarchical_allreducing_in_group, "steps 1 and 3 together|step 1, the reduce-scatter"),
        (hierarchical_gathering_by_allreduce, "(?s)on [34] ranks:.*step 3, the allgather"),
        (hierarchical_skipping_the_reduce_scatter, "step 2"),
        (hierarchical_on_the_world, "(?s)on [34] ranks:.*sent nothing through `comm`.*MPI.COMM_WORLD"),
        (hierarchical_world_rank, "(?s)numbered differently.*notebook's `rank`"),
        (hierarchical_in_float64, "float32.*dtype float64, expected float32"),
        (hierarchical_into_x, "changed x"),
        (hierarchical_into_x_returning_a_copy, "changed x"),
    ],
)
def test_hierarchical_check_fails(fn, says: str) -> None:
    with pytest.raises(CheckFailed, match=says):
        check_hierarchical_allreduce(fn)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("top_k_with_feedback", "ddlab.compression.top_k_with_feedback", ()),
        ("sparse_allreduce", "ddlab.compression.sparse_allreduce", ()),
        ("hierarchical_allreduce", "ddlab.compression.hierarchical_allreduce", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)

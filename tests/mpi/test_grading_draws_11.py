"""Lab 11's checks graded on the grader's draw (ddlab.checks._draw): right answers pass under every seed,
answers fitted to the notebook's cases pass its check and fail the draw, naming the drawn case and the seed.

The same right answers without a seed (the notebook's cases) pass in tests/mpi/test_compression_checks.py
(test_*_check_accepts) and tests/test_qsgd_checks.py: not run twice here. QSGD's check runs without a
communicator; it is here with its lab's others, and costs a fraction of a second.
"""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.allreduce import allgather_ring, reduce_scatter_ring
from ddlab.checks import (
    CheckFailed,
    check_hierarchical_allreduce,
    check_qsgd,
    check_sparse_allreduce,
    check_top_k_with_feedback,
)
from ddlab.checks._draw import Draw
from ddlab.checks.compression import NARROW, _hierarchical_cases, _sparse_cases
from ddlab.compression import held_blocks, hierarchical_allreduce, node_of, qsgd, sparse_allreduce, top_k_with_feedback
from ddlab.compression.compressors import unqsgd
from ddlab.runtime.blocks import block_bounds
from ddlab.runtime.reference import unguarded
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

allgather_ring = unguarded(allgather_ring)
reduce_scatter_ring = unguarded(reduce_scatter_ring)
qsgd = unguarded(qsgd)
unqsgd = unguarded(unqsgd)

RIGHT = [
    (check_top_k_with_feedback, (unguarded(top_k_with_feedback),)),
    (check_sparse_allreduce, (unguarded(sparse_allreduce),)),
    (check_hierarchical_allreduce, (unguarded(hierarchical_allreduce),)),
    (check_qsgd, (qsgd, unqsgd)),
]


@pytest.mark.parametrize("check, right", RIGHT, ids=lambda v: getattr(v, "__name__", ""))
def test_the_library_s_answer_passes_under_every_seed(comm, passes_on_every_seed, check, right):
    passes_on_every_seed(lambda: check(*right), without=False, comm=comm)


def test_the_draws_keep_the_lab_s_domain(grading_seeds):
    for value in grading_seeds:
        sparse = _sparse_cases(Draw(value, "sparse_allreduce"))
        assert all(max(ks) <= n and 0 in ks for n, ks, _ in sparse), "counts within n, one rank with none"
        assert sparse[1][1].count(sparse[1][0]) >= 1 and sparse[1][2] in NARROW, "a rank sending all; 1 or 2 bytes"
        cases = _hierarchical_cases(Draw(value, "hierarchical_allreduce"))
        assert sorted(g for g, _, _ in cases) == [1, 2, 3, 4] and cases[0][1] < 9 and cases[2][2] in NARROW
    assert _sparse_cases(Draw(1, "sparse_allreduce")) != _sparse_cases(Draw(2, "sparse_allreduce"))


# Answers fitted to the notebook's cases -------------------------------------------------


def sparse_by_world_rank(comm, indices, values, n):
    """Lab 11's sparse allreduce that adds its own pairs first and skips them among the gathered ones, by the
    notebook's global `rank` (the world's): the same as comm's on the notebook's first-P ranks, and only there."""
    rank = MPI.COMM_WORLD.Get_rank()
    counts = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([indices.size], dtype=np.int64), counts)
    starts = np.concatenate(([0], np.cumsum(counts)))
    every_index = np.empty(int(counts.sum()), dtype=np.int32)
    every_value = np.empty(int(counts.sum()), dtype=values.dtype)
    comm.Allgatherv(indices, [every_index, counts, starts[:-1], MPI.INT32_T])
    comm.Allgatherv(values, [every_value, counts, starts[:-1], from_numpy_dtype(values.dtype)])
    total = np.zeros(n, dtype=values.dtype)
    np.add.at(total, indices, values)
    others = np.ones(every_index.size, dtype=bool)
    others[starts[rank] : starts[rank + 1]] = False
    np.add.at(total, every_index[others], every_value[others])
    return total


#: The MPI datatypes of the two dtypes lab 11's text says its check runs, and no others.
TWO_TYPES = {np.dtype(np.float64): MPI.DOUBLE, np.dtype(np.float32): MPI.FLOAT}


def ring_of_two_types(comm, x):
    """The allreduce across groups as a ring of its own (reduce-scatter, then allgather, by Sendrecv), naming the
    MPI datatype of x's dtype among the two the lab says its check runs (int16 or int8 items are not 8 bytes)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    kind = TWO_TYPES.get(x.dtype, MPI.DOUBLE)
    out, bounds = x.copy(), block_bounds(x.size, size)
    right, left = (rank + 1) % size, (rank - 1) % size

    def chunk(i):
        return slice(bounds[i % size], bounds[i % size + 1])

    for step in range(2 * (size - 1)):
        gathering = step >= size - 1  # the first P - 1 steps add, the last P - 1 copy (each chunk a step on)
        s = step - gathering * (size - 1)
        send, recv = chunk(rank - s + gathering), chunk(rank - s - 1 + gathering)
        got = np.empty(recv.stop - recv.start, out.dtype)
        comm.Sendrecv([np.ascontiguousarray(out[send]), kind], dest=right, recvbuf=[got, kind], source=left)
        out[recv] = got if gathering else out[recv] + got
    return out


def hierarchical_of_two_types(comm, x, group_size):
    """Lab 11's hierarchical allreduce whose step across groups is ring_of_two_types."""
    rank = comm.Get_rank()
    node = comm.Split(node_of(rank, group_size), rank)
    local, members = node.Get_rank(), node.Get_size()
    blocks = block_bounds(x.size, group_size)
    owned = [held_blocks(r, members, group_size) for r in range(members)]
    cuts = [blocks[held.start] for held in owned] + [x.size]
    holders = [comm.Split(0 if b in owned[local] else MPI.UNDEFINED, rank) for b in range(group_size)]
    part = reduce_scatter_ring(node, x, cuts)
    for b, across in enumerate(holders):
        if across != MPI.COMM_NULL:
            piece = slice(blocks[b] - cuts[local], blocks[b + 1] - cuts[local])
            part[piece] = ring_of_two_types(across, part[piece])
            across.Free()
    out = allgather_ring(node, part, cuts)
    node.Free()
    return out


def qsgd_whole_values_of_s(x, s, rng):
    """QSGD that refuses an s that is not a whole number: the notebook's 2.5, but not a float such as 4.0."""
    if s != int(s) or not 1 <= s <= 127:
        raise ValueError(f"s must be a whole number from 1 to 127, got {s!r}")
    return qsgd(x, int(s), rng)


EVERY = slice(None)  # of the grading seeds: all
FITTED = [  # (check, the fitted answer's arguments, words the failure names besides the seed, the grading seeds tried)
    (
        check_sparse_allreduce,
        (sparse_by_world_rank,),
        ["sparse_allreduce", "pairs here, data seed", "of the check's communicator, in that order"],
        EVERY,
    ),
    (  # the dearest check of the three (each of its cases runs the reference too): one seed, the second
        check_hierarchical_allreduce,
        (hierarchical_of_two_types,),
        ["hierarchical_allreduce (n=", "int", "data seed"],
        slice(1, 2),
    ),
    (check_qsgd, (qsgd_whole_values_of_s, unqsgd), ["qsgd(x, s=", ".0, rng) returned", "raise ValueError"], EVERY),
]


@pytest.mark.parametrize("check, fitted, words, tried", FITTED, ids=lambda v: getattr(v, "__name__", ""))
def test_an_answer_fitted_to_the_notebook_passes_its_check_and_fails_the_draw(
    comm, seed, grading_seeds, check, fitted, words, tried
):
    check(*fitted)  # the notebook's own cases: it passes
    for value in grading_seeds[tried]:
        seed(value)
        with pytest.raises(CheckFailed) as failed:
            check(*fitted)
        message = str(failed.value)
        for word in [*words, f"(the grader's draw, seed {value})"]:
            assert word in message, message

"""Lab 12 in one process: exchange plans of every rank, the I/O model, the files and their counters."""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.data import StressStrainCurves
from ddlab.runtime.blocks import block_bounds
from ddlab.shuffling import (
    affordable_ranks,
    epoch_read_time,
    exchange_plan,
    exchanged_count,
    remove_store,
    stage,
    write_shared,
)
from mpi4py import MPI


@pytest.mark.parametrize("n, size, q", [(10, 3, 0.3), (103, 4, 0.1), (50, 5, 1.0), (7, 4, 0.0), (0, 2, 0.5)])
def test_plans_of_all_ranks_agree_and_keep_counts(n, size, q):
    counts = np.diff(block_bounds(n, size)).tolist()
    plans = [exchange_plan(counts, r, q, epoch=1, seed=4) for r in range(size)]
    for r, (send, recv_counts) in enumerate(plans):
        leaving = np.concatenate(send)
        assert len(np.unique(leaving)) == len(leaving) == exchanged_count(counts[r], q)
        assert recv_counts == [len(plans[s][0][r]) for s in range(size)]
        assert sum(recv_counts) == len(leaving)


def test_exchanged_count_rounds_half_up_and_rejects_bad_q():
    assert [exchanged_count(m, 0.5) for m in (1, 2, 3)] == [1, 1, 2]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        exchanged_count(10, -0.1)


def test_io_model_global_flattens_local_scales():
    args = dict(nbytes=100.0, fs_bandwidth=10.0, link_bandwidth=1.0, local_bandwidth=2.0, net_bandwidth=5.0)
    ranks = np.array([1, 10, 100])
    assert np.allclose(epoch_read_time("global", ranks, **args), [100.0, 10.0, 10.0])
    assert np.allclose(epoch_read_time("local", ranks, **args), [50.0, 5.0, 0.5])
    assert np.allclose(epoch_read_time("partial", ranks, q=1.0, **args), [50.0, 5.0 + 10 * 0.9 / 5, 0.5 + 0.99 / 5])
    assert affordable_ranks(1000.0, 100.0, 10.0) == 100.0
    with pytest.raises(ValueError, match="strategy"):
        epoch_read_time("random", ranks, **args)


def test_store_is_sorted_and_reads_are_counted():
    comm = MPI.COMM_SELF
    root = write_shared(comm, StressStrainCurves(20, seed=2))
    try:
        shared, local = stage(comm, root)
        assert np.all(np.diff(np.asarray(shared.y[:, 0])) >= 0)
        assert shared.bytes_read == 20 * shared.row_bytes  # the staging copy
        x, y = local.read(np.array([3, 1]))
        assert local.bytes_read == 2 * local.row_bytes and np.array_equal(x, shared.x[[3, 1]])
    finally:
        remove_store(comm, root)
    assert not root.exists()

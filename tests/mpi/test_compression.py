"""Lab 11's library on P ranks: compressed and hierarchical allreduces against MPI's."""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.allreduce.cost import Link
from ddlab.compression import (
    GIGABIT_ETHERNET,
    CompressedAllreduce,
    NodePorts,
    SlowLinkComm,
    densify,
    hierarchical_allreduce,
    node_of,
    sparse_allreduce,
    top_k,
)
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def _mine(n: int, dtype: type = np.float64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, WORLD.rank]).standard_normal(n).astype(dtype)


def _mpi_sum(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    WORLD.Allreduce(x, out)
    return out


@pytest.mark.parametrize("n, k", [(0, 0), (10, 1), (1000, 10), (1000, 1000)])
def test_sparse_allreduce_is_the_dense_sum_of_the_sparsified_inputs(comm, n: int, k: int) -> None:
    x = _mine(n, np.float32)
    k = min(k, n) if comm.rank % 2 else max(0, k // 2)  # ranks send different counts
    message = top_k(x, k)
    got = sparse_allreduce(comm, message.indices, message.values, n)
    np.testing.assert_allclose(got, _mpi_sum(densify(message)), rtol=1e-5, atol=1e-6)
    assert got.dtype == np.float32


@pytest.mark.parametrize("method", ["dense", "topk", "randomk", "qsgd8", "sign"])
def test_compressed_allreduce_sums_what_each_rank_sent(comm, method: str) -> None:
    reduce = CompressedAllreduce(method, density=0.05)
    residual = np.zeros(401, np.float32)
    for step in range(3):
        x = _mine(401, np.float32, seed=step)
        before = x.copy()
        got = reduce(comm, x)
        np.testing.assert_array_equal(x, before)
        assert got.shape == x.shape and got.dtype == x.dtype
        if method != "dense":  # each rank sent what it was fed minus what it kept back
            sent = x + residual - reduce.memory[401].residual
            residual = reduce.memory[401].residual.copy()
            x = sent
        np.testing.assert_allclose(got, _mpi_sum(x), rtol=1e-4, atol=1e-4)
    if method != "dense":
        assert reduce.bytes_sent > 0


@pytest.mark.parametrize("method", ["topk", "randomk", "qsgd8", "sign"])
def test_error_feedback_conserves_the_sum_over_ranks(comm, method: str) -> None:
    """Applied sums plus every rank's residual equal the sum of all true gradients, step after step."""
    reduce = CompressedAllreduce(method, density=0.02)
    truth, applied = np.zeros(500), np.zeros(500)
    for step in range(5):
        g = _mine(500, seed=step)
        applied += reduce(comm, g)
        truth += _mpi_sum(g)
        np.testing.assert_allclose(applied + _mpi_sum(reduce.memory[500].residual), truth, atol=1e-9)


@pytest.mark.parametrize("group_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 7, 100, 1001])
def test_hierarchical_equals_mpi_allreduce(comm, group_size: int, n: int) -> None:
    x = np.random.default_rng([n, comm.rank]).integers(-50, 50, n).astype(np.float64)
    got = hierarchical_allreduce(comm, x, group_size)
    np.testing.assert_array_equal(got, _mpi_sum(x))


@pytest.mark.parametrize("group_size", [1, 2, 3])
def test_the_ranks_of_a_node_share_its_one_link(comm, group_size: int) -> None:
    """Bookings made at once by a node's ranks queue one after another; other nodes' do not wait for them."""
    ports = NodePorts(comm, group_size)
    try:
        comm.Barrier()
        ends = comm.allgather(ports.reserve(node_of(comm.rank, group_size), 10.0))  # booked, not slept
    finally:
        ports.free()
    for node in range(-(-comm.size // group_size)):
        mine = sorted(ends[node * group_size : (node + 1) * group_size])
        assert all(b - a >= 10.0 - 1e-6 for a, b in zip(mine, mine[1:]))  # one after another
        assert mine[0] - min(ends) < 10.0  # every node's first booking starts at once


def test_hierarchical_over_a_slow_link_delays_only_traffic_between_groups(comm) -> None:
    link = Link(alpha=1e-4, beta=1e-9)
    slow = SlowLinkComm(comm, 2, link)
    x = _mine(1000)
    np.testing.assert_allclose(hierarchical_allreduce(slow, x, 2), _mpi_sum(x))
    assert GIGABIT_ETHERNET.beta > 0

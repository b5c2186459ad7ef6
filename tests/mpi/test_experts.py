"""The distributed mixture of experts equals its dense fallback, forward and backward (lab 15).

Every rank builds the same dense layer and runs it on every rank's tokens; the
distributed layer runs each rank on its own. float64, 1e-10.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab.experts import MoE, combine, dispatch
from mpi4py import MPI

N_EMBD, EXPERTS = 8, 12


def tokens(rank: int, count: int = 10) -> torch.Tensor:
    return torch.randn(2, count + rank, N_EMBD, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)


@pytest.mark.parametrize("k, capacity_factor", [(1, 20.0), (2, 20.0), (1, 0.5), (2, 1.0)])
def test_moe_equals_dense_forward_and_backward(comm: MPI.Comm, k: int, capacity_factor: float) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    moe = MoE(N_EMBD, EXPERTS, k, capacity_factor, comm, hidden=16, seed=3, dtype=torch.float64)
    dense = MoE(N_EMBD, EXPERTS, k, capacity_factor, None, hidden=16, seed=3, dtype=torch.float64)
    x = tokens(rank).requires_grad_()
    y = moe(x)
    (y * y).sum().backward()
    dropped = comm.allreduce(moe.dropped)
    want_dropped, want_x_grad = 0, None
    for s in range(size):  # one process, every rank's tokens: its gradients sum over ranks
        xs = tokens(s).requires_grad_()
        ys = dense(xs)
        (ys * ys).sum().backward()
        want_dropped += dense.dropped
        if s == rank:
            torch.testing.assert_close(y, ys, rtol=0, atol=1e-10)
            want_x_grad = xs.grad
    assert dropped == want_dropped
    assert (dropped == 0) == (capacity_factor == 20.0)
    torch.testing.assert_close(x.grad, want_x_grad, rtol=0, atol=1e-10)
    gate = moe.gate.weight.grad.clone()
    comm.Allreduce(MPI.IN_PLACE, gate.numpy())
    torch.testing.assert_close(gate, dense.gate.weight.grad, rtol=0, atol=1e-10)
    local = EXPERTS // size
    for j, expert in enumerate(moe.experts):
        want = dense.experts[rank * local + j]
        for got_p, want_p in zip(expert.parameters(), want.parameters()):
            torch.testing.assert_close(got_p.grad, want_p.grad, rtol=0, atol=1e-10)


def test_dispatch_then_combine_returns_every_row(comm: MPI.Comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(rank)
    expert = rng.integers(0, EXPERTS, 7 + 3 * rank)
    x = rng.standard_normal((len(expert), 3))
    rows, counts = dispatch(comm, x, expert, EXPERTS)
    assert counts.shape == (size, EXPERTS // size) and rows.shape == (counts.sum(), 3)
    local = np.concatenate([np.repeat(np.arange(EXPERTS // size), row) for row in counts])
    out = combine(comm, rows * (1 + rank * (EXPERTS // size) + local[:, None]), counts, expert, EXPERTS)
    np.testing.assert_array_equal(out, x * (1 + expert[:, None]))


def test_experts_not_shared_equally_are_refused(comm: MPI.Comm) -> None:
    if comm.Get_size() == 1:
        pytest.skip("any number of experts fits one rank")
    with pytest.raises(ValueError, match="multiple of"):
        MoE(N_EMBD, comm.Get_size() + 1, comm=comm)

"""The distributed mixture of experts equals its dense fallback, forward and backward (lab 15).

Every rank builds the same dense layer and runs it on every rank's tokens; the
distributed layer runs each rank on its own. float64, 1e-10.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab.experts import MoE, average_gradients, combine, dispatch, expert_and_data_groups, train_with_experts
from mpi4py import MPI
from torch import nn

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


def test_a_rank_whose_experts_get_no_row_runs_the_backward_exchanges_too(comm: MPI.Comm, deadline) -> None:
    """Issue 39's hang at step 150: a step where no kept row reached one rank's experts. That rank's
    backward skipped the two Alltoallvs its peers ran (its experts' results were out of autograd's
    graph) and the expert group hung. Here the gate sends every token to expert 0, on rank 0: the
    other ranks' experts get no row. Forward and backward equal the dense fallback (float64, 1e-10),
    within a deadline."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("one rank holds every expert: no rank is left without rows")
    moe = MoE(N_EMBD, EXPERTS, 1, 1.25, comm, hidden=16, seed=3, dtype=torch.float64)
    dense = MoE(N_EMBD, EXPERTS, 1, 1.25, None, hidden=16, seed=3, dtype=torch.float64)
    for layer in (moe, dense):
        with torch.no_grad():
            layer.gate.weight.zero_()
            layer.gate.weight[0, 0] = 10.0  # every token whose first feature is positive chooses expert 0
    x = tokens(rank).abs().requires_grad_()
    with deadline(60):
        y = moe(x)
        (y * y).sum().backward()
        gate = moe.gate.weight.grad.clone()
        comm.Allreduce(MPI.IN_PLACE, gate.numpy())
    assert set(moe.routing.expert.tolist()) == {0}
    for s in range(size):  # one process, every rank's tokens: its gradients sum over ranks
        xs = tokens(s).abs().requires_grad_()
        ys = dense(xs)
        (ys * ys).sum().backward()
        if s == rank:
            torch.testing.assert_close(y, ys, rtol=0, atol=1e-10)
            torch.testing.assert_close(x.grad, xs.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(gate, dense.gate.weight.grad, rtol=0, atol=1e-10)
    for j, expert in enumerate(moe.experts):
        for got, want in zip(expert.parameters(), dense.experts[moe.first + j].parameters()):
            assert got.grad is not None, f"expert {moe.first + j}, given no row, has no gradient: expected zeros"
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-10)


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


class Net(nn.Module):
    """A Linear (replicated, averaged over every rank) before a MoE layer."""

    def __init__(self, comm: MPI.Comm | None) -> None:
        super().__init__()
        self.pre = nn.Linear(N_EMBD, N_EMBD).double()
        with torch.no_grad():
            self.pre.weight.copy_(torch.randn(N_EMBD, N_EMBD, generator=torch.Generator().manual_seed(7)) * 0.5)
            self.pre.bias.zero_()
        self.moe = MoE(N_EMBD, 8, 2, 1.0, comm, hidden=16, seed=5, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(torch.tanh(self.pre(x)))


def _loss(net: Net, x: torch.Tensor) -> torch.Tensor:
    """This rank's mean loss, the balancing loss included (alpha 0.1)."""
    y = net(x)
    return (y - x).square().mean() + 0.1 * net.moe.aux_loss


def test_experts_with_data_parallelism_train_to_one_process(comm: MPI.Comm) -> None:
    """4 ranks, 2 replicas of 2 expert ranks: 6 SGD steps through the router equal one process's (float64, 1e-8).

    One process runs the dense fallback on each rank's tokens in turn (the same routing: capacities
    come from each rank's own tokens) and steps on the mean of the four losses."""
    if comm.Get_size() != 4:
        pytest.skip("a 2 x 2 grid needs 4 ranks")
    rank = comm.Get_rank()
    experts, data = expert_and_data_groups(comm, 2)
    net, dense = Net(experts), Net(None)
    batches = [[tokens(10 * step + r, 12)[0] for r in range(4)] for step in range(6)]
    for step in range(6):
        net.zero_grad()
        _loss(net, batches[step][rank]).backward()
        average_gradients(net, comm, data)
        dense.zero_grad()
        (sum(_loss(dense, x) for x in batches[step]) / 4).backward()
        with torch.no_grad():
            for model in (net, dense):
                for param in model.parameters():
                    param -= 0.5 * param.grad
    first = net.moe.first
    torch.testing.assert_close(net.pre.weight, dense.pre.weight, rtol=0, atol=1e-8)
    torch.testing.assert_close(net.moe.gate.weight, dense.moe.gate.weight, rtol=0, atol=1e-8)
    for j, expert in enumerate(net.moe.experts):
        for got, want in zip(expert.parameters(), dense.moe.experts[first + j].parameters()):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-8)
    moved = (dense.moe.gate.weight - Net(None).moe.gate.weight).abs().max().item()
    assert moved > 1e-3, "the gate did not train: the test would not see a wrong average"
    experts.Free()
    data.Free()


def test_training_with_experts_counts_every_validation_token_and_agrees_on_every_rank(comm: MPI.Comm) -> None:
    """Lab 15 section 11's run, 2 steps: the same losses and loads on every rank, every token counted once."""
    expert_ranks = 2 if comm.Get_size() % 2 == 0 else 1
    losses, load = train_with_experts(comm, expert_ranks, steps=2, alpha=0.01)
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert load.shape == (2, 8)
    np.testing.assert_array_equal(load.sum(axis=1), comm.Get_size() * 4 * 16 * 32)  # k = 1: one expert per token
    assert comm.allgather((losses, load.tolist())) == [(losses, load.tolist())] * comm.Get_size()

"""Tokens to their experts and back: the counts by Alltoall, the rows by Alltoallv (lab 15).

Experts are placed on ranks in blocks: with E experts on P ranks (E a multiple of P),
rank r holds experts r E/P .. (r+1) E/P - 1 (`owner`). A rank's rows (one per kept
assignment) travel to the ranks holding their experts with lab 12's one Alltoallv
(`ddlab.shuffling.exchange_samples`), but first the ranks must learn how much they will
receive: an Alltoall of the counts, E/P numbers (one per expert there) to every rank.

Exercise signatures (lab 15):

- `dispatch(comm, x, expert, n_experts) -> (rows, counts)`: x (n, d) holds this rank's
  rows, expert (n,) int64 the expert of each. One `comm.Alltoall` of the counts
  (int64, E/P per rank: how many rows go to each expert there), then one
  `comm.Alltoallv` of the rows. Returns rows, the rows received, grouped by source rank
  in rank order, within a source by local expert, within that in the sender's order;
  and counts, the (P, E/P) int64 array received: counts[s, j] rows from rank s for
  local expert j. x unchanged.
- `combine(comm, y, counts, expert, n_experts) -> out`: y holds the experts' results
  for the rows dispatch received, in that order; counts and expert as above. One
  `comm.Alltoallv` returns each result to the rank its row came from, and the inverse
  permutation puts it back in place: out[i] is the result for x[i]. y unchanged.

In the layer, `ExchangeRows` is the same Alltoallv as an autograd function: its backward
sends the gradients the reverse way, so dispatch's backward is a combine and combine's
backward a dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..runtime.reference import reference
from ..shuffling.shuffler import exchange_samples


def experts_per_rank(n_experts: int, size: int) -> int:
    """E/P, or a ValueError saying how to choose E when it is not a whole number."""
    if n_experts < 1 or n_experts % size:
        raise ValueError(f"{n_experts} experts cannot be shared equally by {size} ranks: use a multiple of {size}")
    return n_experts // size


def owner(expert: int, n_experts: int, size: int) -> int:
    """The rank holding an expert (experts placed in blocks of E/P)."""
    return expert // experts_per_rank(n_experts, size)


@dataclass
class DispatchPlan:
    """One rank's view of a dispatch: what it sends where, what it receives."""

    order: np.ndarray  # (n,) this rank's rows sorted by expert (stable): the order they leave in
    send: list[np.ndarray]  # send[d]: positions of the rows for rank d, by local expert there
    counts: np.ndarray  # (P, E/P) int64: rows received from each rank for each local expert

    @property
    def sent(self) -> list[int]:
        """Rows sent to each rank (and received back from it by combine)."""
        return [len(s) for s in self.send]

    @property
    def received(self) -> list[int]:
        """Rows received from each rank (and sent back to it by combine)."""
        return self.counts.sum(1).tolist()

    def returns(self) -> list[np.ndarray]:
        """Positions, among the rows received, of those going back to each rank: contiguous blocks."""
        edges = np.concatenate([[0], np.cumsum(self.received)]).astype(np.int64)
        return [np.arange(a, b) for a, b in zip(edges[:-1], edges[1:])]

    def local_expert(self) -> np.ndarray:
        """The local expert (0 .. E/P - 1) of each row received."""
        local = np.arange(self.counts.shape[1])
        return np.concatenate([np.repeat(local, row) for row in self.counts]).astype(np.int64)


def dispatch_plan(comm: MPI.Comm, expert: np.ndarray, n_experts: int) -> DispatchPlan:
    """Sort this rank's rows by expert and exchange the counts (one Alltoall); the rows stay put."""
    size = comm.Get_size()
    local = experts_per_rank(n_experts, size)
    expert = np.asarray(expert)
    if (
        expert.ndim != 1
        or expert.dtype.kind not in "iu"
        or (expert.size and not 0 <= expert.min() <= expert.max() < n_experts)
    ):
        raise ValueError(f"expert must be a 1-D integer array of expert ids in 0..{n_experts - 1}")
    counts = np.bincount(expert, minlength=n_experts).astype(np.int64).reshape(size, local)
    received = np.empty_like(counts)
    comm.Alltoall(counts, received)
    order = np.argsort(expert, kind="stable").astype(np.int64)
    return DispatchPlan(order, np.split(order, np.cumsum(counts.sum(1))[:-1]), received)


@reference("dispatch")
def dispatch(comm: MPI.Comm, x: np.ndarray, expert: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows to the ranks of their experts: counts by Alltoall, then rows by Alltoallv (see the module)."""
    if len(x) != len(expert):
        raise ValueError(f"x has {len(x)} rows but expert has {len(expert)} entries: one expert per row")
    plan = dispatch_plan(comm, expert, n_experts)
    return exchange_samples(comm, x, plan.send, plan.received), plan.counts


@reference("combine")
def combine(comm: MPI.Comm, y: np.ndarray, counts: np.ndarray, expert: np.ndarray, n_experts: int) -> np.ndarray:
    """The experts' results back to their rows' ranks (one Alltoallv), then back in the rows' order."""
    size = comm.Get_size()
    order = np.argsort(expert, kind="stable")
    sent = np.bincount(expert, minlength=n_experts).reshape(size, experts_per_rank(n_experts, size)).sum(1)
    plan = DispatchPlan(order, [], np.asarray(counts, dtype=np.int64))
    if len(y) != sum(plan.received):
        raise ValueError(f"y has {len(y)} rows, but counts say {sum(plan.received)} were received: one result per row")
    back = exchange_samples(comm, y, plan.returns(), sent.tolist())
    out = np.empty_like(back)
    out[order] = back
    return out


class ExchangeRows(torch.autograd.Function):
    """Rows x[send[d]] to rank d by one Alltoallv, received grouped by source; backward the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: MPI.Comm, send: list[np.ndarray], recv: list[int]) -> torch.Tensor:
        ctx.comm, ctx.send, ctx.recv, ctx.rows = comm, send, recv, x.shape[0]
        return torch.from_numpy(exchange_samples(comm, x.detach().contiguous().numpy(), send, recv))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        edges = np.concatenate([[0], np.cumsum(ctx.recv)]).astype(np.int64)
        blocks = [np.arange(a, b) for a, b in zip(edges[:-1], edges[1:])]
        back = exchange_samples(ctx.comm, grad.contiguous().numpy(), blocks, [len(s) for s in ctx.send])
        out = np.zeros((ctx.rows, *grad.shape[1:]), dtype=back.dtype)
        out[np.concatenate(ctx.send).astype(np.int64)] = back
        return torch.from_numpy(out), None, None, None

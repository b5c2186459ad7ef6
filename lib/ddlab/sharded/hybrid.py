"""Hybrid sharding (HSDP): shard inside a group of ranks, replicate across groups.

PyTorch FSDP's HYBRID_SHARD strategy (Zhao et al., "PyTorch FSDP: Experiences on Scaling
Fully Sharded Data Parallel", VLDB 2023, its section on sharding strategies): the P ranks
form R = P / G groups of G ranks (a group stands for a node, whose links are fast); inside a
group the model is sharded G ways as in `Sharded` (ZeRO-1/2/3); across groups it is
replicated, as in data parallelism. Two sub-communicators per rank:

- `shard`: the G ranks of its group (ranks gG .. gG+G-1), which allgather parameters and
  reduce-scatter gradients as full sharding does;
- `replicate`: the R ranks holding the same shard in every group (ranks l, l+G, l+2G, ...),
  which allreduce that shard of the gradient, so every replica steps the same update.

A gradient is thus reduced in two stages: a reduce-scatter inside the group (rank l of the
group gets its group's sum of shard l), then an allreduce of that shard across the groups
(built from the same two halves: a reduce-scatter and an allgather among the R replicas).

Bytes that cross groups per step, N items per unit, b bytes per item (N padded to G's
multiple): only the allreduce does, 2 (R-1)/R of each rank's shard of N/G items, so
2 (R-1) N b over all ranks, whatever the stage. Full sharding over P ranks instead moves
every collective across groups: with each rank sending its chunks straight to their owners
(MPI's collectives as the counting communicator counts them), (P-G) of a rank's P-1 peers are
outside its group, so c (P-G) N b cross, c = 3 for stage 3 (two allgathers, one
reduce-scatter) and 2 for stages 1-2. The ratio is

    HSDP / full = 2 (R-1) / (c (P-G)) = 2 / (c G)          (R > 1; 1/3 for stage 3 on 2 x 2)

With lab 03's ring over all P ranks only R of the P links leave a group, so full sharding
sends c R (P-1)/P N b across and the ratio is 2 (P-G) / (c (P-1)) (4/9 on 2 x 2, stage 3).
What HSDP buys is fewer bytes on the slow links at the price of G-way instead of P-way
sharding: each rank keeps 1/G of the model state, not 1/P.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI
from torch import nn

from ..data_parallel.sync import broadcast_parameters
from ..runtime.comm import Comm
from ..runtime.counting import CountingComm, underlying
from ..runtime.reference import reference
from .collectives import Allgather, CollectivesChoice, ReduceScatter, resolve_collectives
from .zero import Sharded


def even_bounds(n: int, parts: int) -> list[int]:
    """Cut n items into `parts` contiguous pieces whose sizes differ by at most one."""
    return [k * n // parts for k in range(parts + 1)]


@reference("hybrid_reduce_scatter")
def two_stage(replicate: Comm, reduce_scatter: ReduceScatter, allgather: Allgather) -> tuple[ReduceScatter, Allgather]:
    """The (reduce_scatter, allgather) pair of a hybrid model's group.

    Its reduce-scatter sums inside the group (`reduce_scatter` on the group's communicator),
    then allreduces the shard across the groups as `reduce_scatter` then `allgather` on
    `replicate`, and divides by R, the replicas: the mean over groups of the groups' sums,
    which `Sharded` divides by G to make the mean over all P ranks. The allgather is the
    group's own."""
    replicas = replicate.Get_size()

    def reduce_scatter_hybrid(comm: Comm, x: np.ndarray, bounds: list[int]) -> np.ndarray:
        group_sum = reduce_scatter(comm, x, bounds)
        across = even_bounds(group_sum.size, replicas)
        total = allgather(replicate, reduce_scatter(replicate, group_sum, across), across)
        total /= replicas
        return total

    return reduce_scatter_hybrid, allgather


class HybridSharded(Sharded):
    """`module` sharded over groups of `group_size` consecutive ranks of `comm`, replicated across groups.

    A `Sharded` model on the group's communicator whose gradient reduction is two-stage
    (`two_stage`); every option of `Sharded` (stage, prefetch, precision, ledger...) applies.
    The collectives run to their end when started (no overlap with computing). `comm` may be a
    `CountingComm`: both sub-communicators then count into its traffic, peers named by their
    rank in `comm`, so the bytes crossing groups can be told apart.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: MPI.Comm | CountingComm,
        group_size: int,
        collectives: CollectivesChoice = "mpi",
        **options: Any,
    ):
        size, rank = comm.Get_size(), comm.Get_rank()
        if not (isinstance(group_size, int) and 1 <= group_size <= size and size % group_size == 0):
            raise ValueError(
                f"group_size must divide the {size} ranks (groups of equal size), got {group_size!r}: "
                f"use one of {[g for g in range(1, size + 1) if size % g == 0]}"
            )
        if options.pop("broadcast", True):
            broadcast_parameters(module, underlying(comm))  # every replica starts from rank 0's parameters
        self.group_size, self.replicas = group_size, size // group_size
        self.group = rank // group_size
        self.shard_comm = comm.Split(self.group, rank)
        self.replicate_comm = comm.Split(rank % group_size, rank)
        pair = two_stage(self.replicate_comm, *resolve_collectives(collectives))
        super().__init__(module, self.shard_comm, collectives=pair, broadcast=False, **options)

    def close(self) -> None:
        """As `Sharded.close`, and free the two sub-communicators (a collective)."""
        super().close()
        for sub in (self.shard_comm, self.replicate_comm):
            if isinstance(sub, MPI.Comm):
                sub.Free()
            else:
                sub.comm.Free()

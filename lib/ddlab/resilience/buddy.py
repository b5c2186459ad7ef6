"""In-memory (buddy) checkpoints of ZeRO-3 shards: survive a rank's death without touching disk.

Each rank keeps its shard of the flat parameters and a copy of its right neighbour's (rank + 1 mod P),
refreshed every step, the idea of Gemini (Wang et al., SOSP 2023) at its smallest. After one failure
every old shard is still somewhere: the dead rank's on its left neighbour. The survivors gather them
and cut the flat buffer again for P - 1 ranks, with lab 13's `reshard`.

- `reshard(shards, numel, size, rank)`: lab 13's exercise 13.6 (its signature), NumPy only.
- `rebuild_shards(comm, old_rank, old_size, mine, buddy, numel) -> new shard`, exercise 19.4: on the
  survivors' communicator, from each survivor's own old shard and buddy copy, this rank's shard of the
  flat buffer cut for comm's size (a new array, the inputs left alone; any dtype).
- `train_zero3_resilient(comm, problem, steps) -> losses`: ZeRO-3 SGD on a `Regression` (parameters
  allgathered, gradients reduce-scattered, each rank updating its shard, buddies exchanged), each step
  committed by `Agree`; after a failure, `recover`, rebuild, and go on: one process's losses.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..runtime.blocks import block_range
from ..runtime.reference import reference
from .problem import Regression
from .recovery import attempt, recover


@reference("reshard")
def reshard(shards: list[np.ndarray], numel: int, size: int, rank: int) -> np.ndarray:
    """Rank's shard of the flat buffer (ceil(numel / size) items, zeros past numel) from another count's shards."""
    old = shards[0].size
    new = max(1, -(-numel // size))
    out = np.zeros(new, dtype=shards[0].dtype)
    start, stop = rank * new, min((rank + 1) * new, numel)
    for q in range(start // old, -(-stop // old)) if stop > start else ():
        lo, hi = max(start, q * old), min(stop, (q + 1) * old)
        out[lo - start : hi - start] = shards[q][lo - q * old : hi - q * old]
    return out


@reference("rebuild_shards")
def rebuild_shards(
    comm: MPI.Comm, old_rank: int, old_size: int, mine: np.ndarray, buddy: np.ndarray, numel: int
) -> np.ndarray:
    """This survivor's new shard: every old shard gathered from its owner or its buddy, resharded for comm."""
    held: dict[int, np.ndarray] = {}
    for q, own, copy in comm.allgather((old_rank, mine, buddy)):
        held.setdefault(q, own)
        held.setdefault((q + 1) % old_size, copy)
    lost = [q for q in range(old_size) if q not in held]
    if lost:
        raise RuntimeError(f"old shards {lost} are gone with their buddies: two neighbours died between steps")
    return reshard([held[q] for q in range(old_size)], numel, comm.Get_size(), comm.Get_rank())


def _shard_size(numel: int, size: int) -> int:
    return max(1, -(-numel // size))


def _exchange_buddies(comm: MPI.Comm, mine: np.ndarray) -> np.ndarray:
    """Send my shard to my left neighbour, receive my right neighbour's: my buddy copy."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buddy = np.empty_like(mine)
    comm.Sendrecv(mine, dest=(rank - 1) % size, sendtag=19, recvbuf=buddy, source=(rank + 1) % size, recvtag=19)
    return buddy


def _zero3_step(
    comm: MPI.Comm, problem: Regression, mine: np.ndarray, ids: np.ndarray, numel: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """One ZeRO-3 step: (my new shard, my new buddy copy, the mean loss); nothing of the old state changed."""
    size, shard = comm.Get_size(), mine.size
    full = np.empty(shard * size)
    comm.Allgather(mine, full)  # the unit's parameters, gathered before its forward
    loss, grad = problem.loss_and_grad(full[:numel], ids)
    padded = np.zeros(1 + shard * size)
    padded[0], padded[1 : 1 + numel] = loss, grad
    total = np.empty(1)
    comm.Allreduce(padded[:1], total)
    grad_shard = np.empty(shard)
    comm.Reduce_scatter_block(padded[1:], grad_shard)  # each rank keeps the sum over ranks of its shard
    new = mine - problem.lr * grad_shard / problem.batch
    return new, _exchange_buddies(comm, new), float(total[0] / problem.batch)


def train_zero3_resilient(comm: MPI.Comm, problem: Regression, steps: int) -> list[float]:
    """ZeRO-3 SGD for `steps` steps over `comm` with buddy checkpoints, surviving deaths: one process's losses."""
    numel = problem.initial().size
    size, shard = comm.Get_size(), _shard_size(numel, comm.Get_size())
    start = np.zeros(shard * size)
    start[:numel] = problem.initial()
    mine = start[comm.Get_rank() * shard : (comm.Get_rank() + 1) * shard].copy()
    buddy = _exchange_buddies(comm, mine)
    losses: list[float] = []
    step = 0
    while step < steps:
        rank, size = comm.Get_rank(), comm.Get_size()
        span = block_range(problem.batch, rank, size)
        ids = problem.batch_ids(step)[span.start : span.stop]
        done = attempt(comm, _zero3_step, comm, problem, mine, ids, numel)
        if done is not None:
            mine, buddy, loss = done
            losses.append(loss)
            step += 1
            continue
        old_rank, old_size = comm.Get_rank(), comm.Get_size()
        comm, step = recover(comm, step)
        mine = rebuild_shards(comm, old_rank, old_size, mine, buddy, numel)
        buddy = _exchange_buddies(comm, mine)
    return losses

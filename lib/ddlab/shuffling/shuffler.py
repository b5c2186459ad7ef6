"""Global, local and partial-local shuffling over file-backed shards, with I/O counters (lab 12).

After Nguyen et al., "Why Globally Re-shuffle? Revisiting Data Shuffling in Large
Scale Deep Learning" (IPDPS 2022). Every epoch each rank trains on as many samples as
its partition holds (block sizes of n over P ranks), in an order given by:

- **global**: one permutation of all n samples per epoch, the same on every rank
  (`epoch_permutation`); rank r takes block r of it and reads those samples from the
  shared copy. Every epoch reads the whole data set from shared storage.
- **local**: rank r shuffles its own partition, read from local storage. Only the first
  copy (`stage`) touches shared storage, but a rank sees the same slice forever. With
  equal batches from equal partitions the averaged gradient is still a stratified,
  unbiased sample; what a sorted slice distorts is what a rank computes from its batch
  alone (BatchNorm's statistics in lab 12's network). Nguyen et al. partition at
  random; `storage` sorts, the worst case.
- **partial** (partial-local, exchange fraction Q): at the start of every epoch each
  rank sends round(Q m) of its m local samples to other ranks with one Alltoallv and
  receives as many, then shuffles what it holds. Q = 0 is local; Q = 1 deals out a
  fresh random partition, like global, moving samples over the network instead of
  reading them from shared storage.

Exercise signatures (lab 12):

- `exchange_plan(counts, rank, q, epoch, seed=0) -> (send, recv_counts)`: counts[r] is
  how many samples rank r holds; returns send, a list of `len(counts)` int64 arrays
  (send[d]: positions in this rank's holding that go to rank d, d == rank allowed), and
  recv_counts, a list of ints (recv_counts[s]: how many this rank receives from s).
  Every rank computes its plan alone, from (counts, q, epoch, seed), with no messages,
  and the plans agree: what r sends to s is what s expects from r. A rank sends
  round(Q m) distinct positions in all and receives as many.
- `exchange_samples(comm, x, send, recv_counts) -> np.ndarray`: x holds one sample per
  row (any shape after the first axis, any dtype); one `comm.Alltoallv` carries exactly
  rows x[send[d]] to each rank d; returns a new array of the rows received, grouped by
  source rank in rank order, each group in the order its sender listed it. x unchanged.
- `redistribute(comm, x, holds, needs) -> np.ndarray`: the whole exchange from a diagram
  of which sample ids each rank holds (holds[r], row order of its x) and which it needs
  (needs[r], in order); returns the rows of needs[rank] in that order, new, x unchanged,
  all carried by one Alltoallv (global shuffling's permutation served from the ranks'
  holdings instead of the shared copy, as a cache such as NoPFS does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ..data.sharding import epoch_permutation
from ..runtime.blocks import block_bounds, block_range
from ..runtime.reference import reference
from .storage import SampleFiles

STRATEGIES = ("global", "local", "partial")


def exchanged_count(m: int, q: float) -> int:
    """How many of m samples a rank sends away for exchange fraction q: round(q m), halves up."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"the exchange fraction q must lie in [0, 1], got {q}")
    return int(np.floor(q * m + 0.5))


@reference("exchange_plan")
def exchange_plan(
    counts: list[int], rank: int, q: float, epoch: int, seed: int = 0
) -> tuple[list[np.ndarray], list[int]]:
    """Which of this rank's samples go to which rank this epoch, and how many arrive from each.

    Each rank r picks k_r = round(q m_r) of its positions (sorted), from a generator
    seeded by (seed, epoch, r), so the others know k_r without a message. The picked
    samples of all ranks, in rank order, form a pool of K = sum k_r; the pool is
    permuted by `epoch_permutation(K, epoch, seed)` (the one global shuffling uses) and
    dealt back in blocks of k_0, k_1, ... So every rank gets back as many as it gave.
    """
    size = len(counts)
    picked = [exchanged_count(m, q) for m in counts]
    starts = np.concatenate([[0], np.cumsum(picked)]).astype(np.int64)
    slot_owner = np.repeat(np.arange(size), picked)  # new slot j of the pool goes to rank slot_owner[j]
    destination = np.empty(starts[-1], dtype=np.int64)
    destination[epoch_permutation(int(starts[-1]), epoch, seed)] = slot_owner  # pool item -> rank
    rng = np.random.default_rng([seed, epoch, rank])
    chosen = np.sort(rng.choice(counts[rank], picked[rank], replace=False)).astype(np.int64)
    mine = destination[starts[rank] : starts[rank + 1]]
    send = [chosen[mine == d] for d in range(size)]
    recv_counts = [int(np.count_nonzero(destination[starts[s] : starts[s + 1]] == rank)) for s in range(size)]
    return send, recv_counts


@reference("exchange_samples")
def exchange_samples(comm: MPI.Comm, x: np.ndarray, send: list[np.ndarray], recv_counts: list[int]) -> np.ndarray:
    """Rows x[send[d]] to rank d, all in one Alltoallv; the rows received, grouped by source."""
    row = int(np.prod(x.shape[1:], dtype=np.int64))  # elements per sample
    outgoing = np.ascontiguousarray(x[np.concatenate(send).astype(np.int64)] if send else x[:0])
    incoming = np.empty((sum(recv_counts), *x.shape[1:]), dtype=x.dtype)
    send_counts = np.array([len(s) for s in send], dtype=np.int64) * row
    recv_elems = np.array(recv_counts, dtype=np.int64) * row
    comm.Alltoallv(
        [outgoing, (send_counts, _displacements(send_counts))], [incoming, (recv_elems, _displacements(recv_elems))]
    )
    return incoming


@reference("redistribute")
def redistribute(comm: MPI.Comm, x: np.ndarray, holds: list[np.ndarray], needs: list[np.ndarray]) -> np.ndarray:
    """The rows of the samples this rank needs, in the order it needs them, fetched from their holders.

    The diagram, known to every rank: holds[r] lists the sample ids rank r holds (row i
    of its x is sample holds[r][i]); needs[r] the ids rank r must hold after, in order.
    Ids are 0..n-1, each held by one rank and needed by one. One Alltoallv carries to
    each rank d the rows of needs[d] this rank holds, in d's order; what arrives, grouped
    by source, is put back in the order of needs[rank].
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    _check_diagram(x, holds, needs, rank, size)
    n = sum(len(ids) for ids in holds)
    owner, position = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for r, ids in enumerate(holds):
        owner[ids], position[ids] = r, np.arange(len(ids))
    outgoing_ids = [np.asarray(needs[d])[owner[needs[d]] == rank] for d in range(size)]
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    outgoing = np.ascontiguousarray(x[position[np.concatenate(outgoing_ids).astype(np.int64)]])
    send_counts = np.array([len(ids) for ids in outgoing_ids], dtype=np.int64) * row
    source = owner[needs[rank]]
    recv_counts = np.bincount(source, minlength=size).astype(np.int64) * row
    incoming = np.empty((len(source), *x.shape[1:]), dtype=x.dtype)
    comm.Alltoallv(
        [outgoing, (send_counts, _displacements(send_counts))], [incoming, (recv_counts, _displacements(recv_counts))]
    )
    placed = np.empty_like(incoming)
    placed[np.argsort(source, kind="stable")] = incoming
    return placed


def _check_diagram(x: np.ndarray, holds: list[np.ndarray], needs: list[np.ndarray], rank: int, size: int) -> None:
    """Raise ValueError, saying what to fix, unless holds and needs describe one layout each of ids 0..n-1."""
    if len(holds) != size or len(needs) != size:
        raise ValueError(f"holds and needs need one array of ids per rank ({size}), got {len(holds)} and {len(needs)}")
    if len(x) != len(holds[rank]):
        raise ValueError(f"x has {len(x)} rows but holds[{rank}] lists {len(holds[rank])} ids: one row per id held")
    n = sum(len(ids) for ids in holds)
    for name, layout in (("holds", holds), ("needs", needs)):
        ids = np.concatenate([np.asarray(i, dtype=np.int64).ravel() for i in layout])
        if not np.array_equal(np.sort(ids), np.arange(n)):
            raise ValueError(f"{name} must list every sample id 0..{n - 1} exactly once over all ranks")


def _displacements(counts: np.ndarray) -> np.ndarray:
    """Where each rank's block starts: the exclusive prefix sum of the counts."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


@dataclass
class IOCounters:
    """Bytes one rank moved in one epoch."""

    shared: int = 0  # read from the shared copy
    local: int = 0  # read from node-local storage
    exchanged: int = 0  # sent to other ranks


class Shuffler:
    """One rank's samples for each epoch under a strategy, read from files and counted.

        shuffler = Shuffler(comm, root, "partial", q=0.3)
        for epoch in range(epochs):
            order = shuffler.start_epoch(epoch)   # exchanges first, for "partial"
            for k in range(0, len(order), b):
                x, y = shuffler.read(order[k:k + b])
        shuffler.counters   # one IOCounters per epoch (staging counts in epoch 0)

    `order` holds sample ids (rows of the shared copy). Created collectively (it stages
    the local partition); `start_epoch` is collective for "partial".
    """

    def __init__(
        self, comm: MPI.Comm, shared: SampleFiles, local: SampleFiles, strategy: str, q: float = 0.0, seed: int = 0
    ):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        exchanged_count(1, q)  # validates q
        self.comm, self.strategy, self.q, self.seed = comm, strategy, q, seed
        self.shared, self.local = shared, local
        self.n = len(shared)
        self.counts = np.diff(block_bounds(self.n, comm.Get_size())).tolist()
        self.counters: list[IOCounters] = []
        self._staged = shared.bytes_read  # the copy `stage` made, charged to the first epoch
        # What this rank holds, sorted by id: the staged partition, then what exchanges leave.
        # (Kept in memory, node-local storage at its fastest; the exchange replaces rows in it.)
        self._x, self._y, self._ids = np.asarray(local.x), np.asarray(local.y), np.asarray(local.ids)

    def start_epoch(self, epoch: int) -> np.ndarray:
        """This epoch's sample ids for this rank, in training order (after the exchange, for "partial")."""
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        self.counters.append(IOCounters(shared=self._staged if self.strategy != "global" else 0))
        self._staged = 0
        if self.strategy == "global":
            return epoch_permutation(self.n, epoch, self.seed)[_as_slice(block_range(self.n, rank, size))]
        if self.strategy == "partial" and self.q > 0:
            self._exchange(epoch)
        order = np.random.default_rng([self.seed, epoch, rank, size]).permutation(len(self._ids))
        return self._ids[order]

    def _exchange(self, epoch: int) -> None:
        rank = self.comm.Get_rank()
        send, recv_counts = exchange_plan(self.counts, rank, self.q, epoch, self.seed)
        leaving = np.concatenate(send)
        self.counters[-1].exchanged = sum(len(s) for d, s in enumerate(send) if d != rank) * self.local.row_bytes
        arrived = [exchange_samples(self.comm, part, send, recv_counts) for part in (self._x, self._y, self._ids)]
        keep = np.setdiff1d(np.arange(len(self._ids)), leaving)
        x, y, ids = (np.concatenate([part[keep], new]) for part, new in zip((self._x, self._y, self._ids), arrived))
        by_id = np.argsort(ids, kind="stable")
        self._x, self._y, self._ids = x[by_id], y[by_id], ids[by_id]

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of these samples: from the shared copy (global) or from what this rank holds."""
        counters = self.counters[-1]
        if self.strategy == "global":
            before = self.shared.bytes_read
            x, y = self.shared.read(ids)
            counters.shared += self.shared.bytes_read - before
            return x, y
        positions = np.searchsorted(self._ids, ids)
        counters.local += len(positions) * self.local.row_bytes
        return self._x[positions], self._y[positions]


def _as_slice(block: range) -> slice:
    return slice(block.start, block.stop)

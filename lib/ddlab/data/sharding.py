"""Which samples each rank trains on: disjoint shards, reshuffled every epoch from a seed.

Every rank draws the same permutation of the n samples for an epoch (it depends only
on the seed and the epoch number, so no message is needed), then takes every P-th
entry, starting at its rank, as torch's DistributedSampler does. Strided shards have
a property block shards lack: step k's per-rank batches of b samples, put together,
are entries k*P*b .. (k+1)*P*b of the permutation, exactly the batch one process
with batch P*b takes at step k.

When P does not divide n, ranks would get shards of different lengths, take
different numbers of steps, and the last allreduce would wait forever for the ranks
that ran out. So every shard has the same length:
- remainder="pad" (default): the permutation is extended with its own first entries
  until P divides it; a few samples are seen twice per epoch.
- remainder="drop": the last n % P entries of the permutation are left out this
  epoch (other samples next epoch, since the permutation changes).

Evaluation needs no shuffling and no equal lengths (sums and counts are reduced, not
averaged per rank): `eval_shard` gives contiguous blocks (ddlab.runtime.blocks.block_range).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..runtime.blocks import block_range
from ..runtime.reference import reference

REMAINDERS = ("pad", "drop")


def epoch_permutation(n: int, epoch: int, seed: int = 0) -> np.ndarray:
    """The order of the n samples in this epoch: the same on every rank for a given (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def shard_length(n: int, size: int, remainder: str = "pad") -> int:
    """Samples per rank and epoch: ceil(n / size) when padding, floor when dropping."""
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {REMAINDERS}, got {remainder!r}")
    return -(-n // size) if remainder == "pad" else n // size


@reference("shard_indices")
def shard_indices(
    n: int, rank: int, size: int, epoch: int, seed: int = 0, remainder: str = "pad", shuffle: bool = True
) -> np.ndarray:
    """The sample indices `rank` trains on in `epoch`, in the order it takes them."""
    if size < 1 or not 0 <= rank < size or n < 0:
        raise ValueError(f"need n >= 0 and 0 <= rank < size, got n={n}, rank={rank}, size={size}")
    order = epoch_permutation(n, epoch, seed) if shuffle else np.arange(n)
    total = shard_length(n, size, remainder) * size
    if total > n:  # pad by wrapping around (np.resize repeats the array as often as needed)
        order = np.resize(order, total)
    return order[rank:total:size]


def eval_shard(n: int, rank: int, size: int) -> range:
    """Contiguous, unshuffled, unpadded block of n samples for evaluation on `rank`."""
    return block_range(n, rank, size)


class ShardedSampler:
    """A rank's shard for each epoch, cut into batches.

    sampler = ShardedSampler(len(data), comm.rank, comm.size, seed=0)
    for epoch in range(epochs):
        for idx in sampler.batches(batch_size, epoch):
            x, y = data[idx]
    """

    def __init__(self, n: int, rank: int, size: int, seed: int = 0, remainder: str = "pad", shuffle: bool = True):
        shard_length(n, size, remainder)  # validates remainder
        self.n, self.rank, self.size = n, rank, size
        self.seed, self.remainder, self.shuffle = seed, remainder, shuffle

    def __len__(self) -> int:
        return shard_length(self.n, self.size, self.remainder)

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's samples in `epoch`."""
        return shard_indices(self.n, self.rank, self.size, epoch, self.seed, self.remainder, self.shuffle)

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        """Batches per epoch: the same on every rank, since shards have the same length."""
        return len(self) // batch_size if drop_last else -(-len(self) // batch_size)

    def batches(self, batch_size: int, epoch: int, drop_last: bool = False) -> Iterator[np.ndarray]:
        """Consecutive batches of this rank's shard; the last may be smaller unless drop_last."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        mine = self.indices(epoch)
        for k in range(self.num_batches(batch_size, drop_last)):
            yield mine[k * batch_size : (k + 1) * batch_size]

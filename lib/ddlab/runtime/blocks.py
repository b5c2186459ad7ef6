"""Split n items over P ranks in contiguous blocks, the first n % P ranks one item larger.

Used wherever work is divided: data shards, allreduce chunks, pipeline stages.
"""

from __future__ import annotations

from .reference import reference


@reference("block_range")
def block_range(n: int, rank: int, size: int) -> range:
    """The indices rank owns when n items are split over size ranks."""
    if size < 1 or not 0 <= rank < size or n < 0:
        raise ValueError(f"need n >= 0 and 0 <= rank < size, got n={n}, rank={rank}, size={size}")
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def block_bounds(n: int, size: int) -> list[int]:
    """The size+1 boundaries of the blocks: block r is [bounds[r], bounds[r+1])."""
    return [block_range(n, r, size).start for r in range(size)] + [n]

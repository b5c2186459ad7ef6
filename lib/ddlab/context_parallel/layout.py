"""Which sequence positions each rank holds: the contiguous split and the zig-zag one, with padding.

A sequence of `length` tokens is padded to a multiple of 2P and cut into 2P chunks of c rows.
The contiguous split gives rank r chunks 2r and 2r+1; the zig-zag split gives it chunk r and
chunk 2P-1-r, one early and one late, so that under the causal mask every rank has the same
work (Striped Attention, Brandon et al. 2023, balances it by striping instead; this two-chunk
layout is ring-flash-attention's and Megatron-LM's, and Llama 3 cuts its sequences into the same
2P chunks, though it all-gathers keys and values instead of a ring: Dubey et al., "The Llama 3
Herd of Models", 2024, section 3.3.2). Padding rows sit past the end: their positions are >= length, so no real query
sees them (the causal mask hides them for free) and their outputs are dropped.
"""

from __future__ import annotations

import numpy as np

from ..runtime.reference import reference


def padded_length(length: int, size: int) -> int:
    """length rounded up to a multiple of 2 * size (at least 2 * size)."""
    if length < 1 or size < 1:
        raise ValueError(f"length and size must be positive, got length={length}, size={size}")
    return 2 * size * max(1, -(-length // (2 * size)))


@reference("zigzag")
def zigzag_positions(length: int, size: int, rank: int) -> np.ndarray:
    """Global positions rank holds in the zig-zag split: chunk rank, then chunk 2*size-1-rank."""
    c = padded_length(length, size) // (2 * size)
    late = 2 * size - 1 - rank
    return np.concatenate([np.arange(rank * c, (rank + 1) * c), np.arange(late * c, (late + 1) * c)])


def contiguous_positions(length: int, size: int, rank: int) -> np.ndarray:
    """Global positions rank holds in the naive split: one contiguous stretch of the padded sequence."""
    n = padded_length(length, size) // size
    return np.arange(rank * n, (rank + 1) * n)


def all_positions(length: int, size: int, zigzag: bool = True) -> np.ndarray:
    """(size, n) array: row r holds rank r's positions, zig-zag or contiguous."""
    of = zigzag_positions if zigzag else contiguous_positions
    return np.stack([of(length, size, rank) for rank in range(size)])


def take_rows(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x's rows (axis -2) at positions, padding positions past the end with zero rows; a new array."""
    length = x.shape[-2]
    out = np.zeros((*x.shape[:-2], positions.size, x.shape[-1]), dtype=x.dtype)
    real = positions < length
    out[..., real, :] = x[..., positions[real], :]
    return out


def put_rows(parts: list[np.ndarray], positions: np.ndarray, length: int) -> np.ndarray:
    """The inverse of take_rows over all ranks: rank r's rows back at positions[r], padding dropped."""
    first = parts[0]
    out = np.empty((*first.shape[:-2], length, first.shape[-1]), dtype=first.dtype)
    for part, where in zip(parts, positions):
        real = where < length
        out[..., where[real], :] = part[..., real, :]
    return out


def visible(q_pos: np.ndarray, k_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, columns) of a block that the causal mask leaves any work in: queries that see some key, keys seen."""
    if q_pos.size == 0 or k_pos.size == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    rows = np.flatnonzero(q_pos >= k_pos.min())
    cols = np.flatnonzero(k_pos <= q_pos.max())
    if rows.size == 0 or cols.size == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    return rows, cols


def causal_work(positions: np.ndarray) -> np.ndarray:
    """Scores each rank computes in ring attention with this layout (rows x columns of each block's rectangle)."""
    work = np.zeros(len(positions), dtype=np.int64)
    for rank, mine in enumerate(positions):
        for theirs in positions:
            rows, cols = visible(mine, theirs)
            work[rank] += rows.size * cols.size
    return work


def causal_pairs(positions: np.ndarray, length: int) -> np.ndarray:
    """(query, key) pairs the causal mask keeps for each rank's real queries: the work no schedule avoids."""
    return np.array([int(np.sum(p[p < length] + 1)) for p in positions])

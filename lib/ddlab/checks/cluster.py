"""Checks for lab 00."""

from __future__ import annotations

from typing import Callable

from ..runtime.blocks import block_range
from .errors import CheckFailed


def check_block_range(fn: Callable[[int, int, int], range]) -> None:
    """fn(n, rank, size) must give a range per rank: contiguous blocks in rank order that tile range(n),
    the first n % size ranks one item larger."""
    for size in (1, 2, 3, 4, 7):
        for n in (0, 1, 3, 4, 10, 101):
            got = [fn(n, rank, size) for rank in range(size)]
            want = [block_range(n, rank, size) for rank in range(size)]
            for rank, g in enumerate(got):
                if not isinstance(g, range):
                    raise CheckFailed(
                        f"n={n}, size={size}: rank {rank} got a {type(g).__name__}, expected a range: "
                        "return range(start, stop), which holds two numbers however many items "
                        "the block has"
                    )
            for rank, (g, w) in enumerate(zip(got, want)):
                if list(g) != list(w):
                    raise CheckFailed(
                        f"n={n} items over size={size} ranks: rank {rank} got indices "
                        f"{list(g)[:8]}{'...' if len(g) > 8 else ''}, expected {list(w)[:8]}"
                        f"{'...' if len(w) > 8 else ''} (blocks in rank order, the first "
                        f"n % size = {n % size} ranks one item larger)"
                    )
    print("passed: block_range splits n items into contiguous, balanced blocks")

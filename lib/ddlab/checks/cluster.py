"""Checks for lab 00."""

from __future__ import annotations

from typing import Callable

from ..runtime.blocks import block_range
from ._draw import grading_draw, named
from .errors import CheckFailed


def check_block_range(fn: Callable[[int, int, int], range]) -> None:
    """fn(n, rank, size) must give a range per rank: contiguous blocks in rank order that tile range(n),
    the first n % size ranks one item larger. The grader's draw: 5 sizes up to 64, 6 counts up to 10000."""
    draw = grading_draw(None, "block_range")
    sizes = (1, 2, 3, 4, 7) if draw is None else draw.lengths(5, 1, 64, "sizes")
    counts = (0, 1, 3, 4, 10, 101) if draw is None else draw.lengths(6, 0, 10000, "counts")
    for size in sizes:
        for n in counts:
            got = [fn(n, rank, size) for rank in range(size)]
            want = [block_range(n, rank, size) for rank in range(size)]
            for rank, g in enumerate(got):
                if not isinstance(g, range):
                    raise CheckFailed(
                        f"n={n}, size={size}{named(draw)}: rank {rank} got a {type(g).__name__}, expected a range: "
                        "return range(start, stop), which holds two numbers however many items "
                        "the block has"
                    )
            for rank, (g, w) in enumerate(zip(got, want)):
                if list(g) != list(w):
                    raise CheckFailed(
                        f"n={n} items over size={size} ranks{named(draw)}: rank {rank} got indices "
                        f"{list(g)[:8]}{'...' if len(g) > 8 else ''}, expected {list(w)[:8]}"
                        f"{'...' if len(w) > 8 else ''} (blocks in rank order, the first "
                        f"n % size = {n % size} ranks one item larger)"
                    )
    print(f"passed: block_range splits n items into contiguous, balanced blocks{named(draw)}")

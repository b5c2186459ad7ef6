"""Which rows of an image each rank holds: slabs that stay whole through every pooling level.

Rank r of P holds rows bounds[r] to bounds[r+1]-1 of every feature map at full
resolution. After l halvings (2x2 pooling) it holds rows bounds[r] / 2**l to
bounds[r+1] / 2**l - 1, which is only a whole number of rows if every bound is a
multiple of 2**l. So the image is cut into blocks of 2**levels rows, and the blocks
are dealt out as evenly as possible (the first ranks one block more when they do
not divide evenly): slabs may differ by one block, never more.

Exercise 8.3 signature: `slab_bounds(height, size, levels) -> list[int]`: the size+1
increasing row bounds from 0 to height, every one a multiple of 2**levels, the slabs
as even as possible (their sizes differ by at most 2**levels rows, every slab at least
2**levels rows); ValueError when height is not a multiple of 2**levels or has fewer
than `size` blocks of 2**levels rows.
"""

from __future__ import annotations

from ..runtime.blocks import block_bounds
from ..runtime.reference import reference


@reference("slab_bounds")
def slab_bounds(height: int, size: int, levels: int = 0) -> list[int]:
    """Row bounds of `size` slabs of an image `height` rows high that survive `levels` halvings."""
    unit = 2**levels
    if size < 1 or levels < 0 or height % unit:
        raise ValueError(
            f"cannot cut {height} rows into {size} slabs for {levels} pooling levels: "
            f"the height must be a multiple of 2**levels = {unit} (and size >= 1)"
        )
    blocks = height // unit
    if blocks < size:
        raise ValueError(
            f"{height} rows hold only {blocks} blocks of {unit} rows (2**levels) for {size} ranks: "
            "use fewer ranks, fewer levels or a taller image"
        )
    return [unit * b for b in block_bounds(blocks, size)]

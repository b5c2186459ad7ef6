"""The flat parameter space of one unit: every parameter in one buffer, cut into P equal shards.

A unit's parameters are laid end to end in one 1-D buffer of N items, padded with
zeros to N' = P * ceil(N / P) items so that every rank owns one contiguous shard of
N' / P items: rank r owns items [r N'/P, (r+1) N'/P). Equal shards let one
reduce-scatter and one allgather move the whole unit (MPI's Iallgather needs equal
pieces; the padding costs at most P - 1 items). Each `nn.Parameter` then becomes a
view of its slice of the full buffer (`FlatSpace.views`), so filling the buffer by
one allgather fills every parameter, and freeing the buffer's storage frees them all.
This is the layout of PyTorch FSDP's FlatParameter (Zhao et al., "PyTorch FSDP:
Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..runtime.reference import reference


@reference("zero3_unit")  # exercise 13.5 builds the flat buffer itself
@dataclass(frozen=True)
class FlatSpace:
    """Where each of `shapes` lives in the padded flat buffer of a unit shared by `size` ranks."""

    shapes: tuple[torch.Size, ...]
    size: int
    offsets: tuple[int, ...] = field(init=False)
    numel: int = field(init=False)  # N: the parameters' items, without padding

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a flat space is shared by at least one rank, got size={self.size}")
        offsets, total = [], 0
        for shape in self.shapes:
            offsets.append(total)
            total += shape.numel()
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "numel", total)

    @classmethod
    def of(cls, params: Sequence[torch.Tensor], size: int) -> FlatSpace:
        return cls(tuple(p.shape for p in params), size)

    @property
    def shard_numel(self) -> int:
        """Items per shard: ceil(N / P) (at least 1, so every rank owns a piece)."""
        return max(1, -(-self.numel // self.size))

    @property
    def padded(self) -> int:
        """N' = P * shard_numel."""
        return self.shard_numel * self.size

    @property
    def bounds(self) -> list[int]:
        """Shard r is items bounds[r]:bounds[r+1] of the padded buffer."""
        return [r * self.shard_numel for r in range(self.size + 1)]

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's shard of a padded flat buffer (a view)."""
        return flat[rank * self.shard_numel : (rank + 1) * self.shard_numel]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of `flat`, shaped like it (views: writing one writes the buffer)."""
        return [flat[o : o + shape.numel()].view(shape) for o, shape in zip(self.offsets, self.shapes)]

    def flatten(self, tensors: Sequence[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
        """A new padded buffer holding `tensors` (None counts as zeros) in `dtype`."""
        flat = torch.zeros(self.padded, dtype=dtype)
        for view, tensor in zip(self.views(flat), tensors):
            if tensor is not None:
                view.copy_(tensor)
        return flat

"""A synthetic segmentation set made locally: noisy images of disks and squares, and their masks.

Every pixel has a class: 0 background, 1 disk, 2 square. Images of any side can be
made in milliseconds from a seed, so every rank can make the same batch itself
instead of receiving it, and image size is a free knob for memory experiments.
"""

from __future__ import annotations

import torch

CLASSES = 3


def make_segmentation(
    n: int, side: int, seed: int = 0, shapes: int = 3, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """n images (n, 3, side, side) and masks (n, side, side) of class indices, from `seed`.

    Each image holds `shapes` disks or squares of random colour, size and place on a
    noisy background; the mask marks which pixels belong to which kind of shape.
    """
    if n < 0 or side < 4 or shapes < 0:
        raise ValueError(f"need n >= 0, side >= 4 and shapes >= 0, got n={n}, side={side}, shapes={shapes}")
    gen = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.arange(side, dtype=dtype), torch.arange(side, dtype=dtype), indexing="ij")
    images = 0.3 * torch.rand(n, 3, side, side, generator=gen, dtype=dtype)
    masks = torch.zeros(n, side, side, dtype=torch.long)
    for i in range(n):
        for _ in range(shapes):
            kind = int(torch.randint(1, CLASSES, (), generator=gen))
            radius = side * (0.06 + 0.12 * float(torch.rand((), generator=gen)))
            cy, cx = (side * torch.rand(2, generator=gen, dtype=dtype)).tolist()
            if kind == 1:
                inside = (ys - cy) ** 2 + (xs - cx) ** 2 <= radius**2
            else:
                inside = ((ys - cy).abs() <= radius) & ((xs - cx).abs() <= radius)
            colour = 0.4 + 0.6 * torch.rand(3, 1, generator=gen, dtype=dtype)
            images[i][:, inside] = colour
            masks[i][inside] = kind
    return images, masks

"""float8 casts with scales: per tensor, from a delayed amax history, and per block (lab 18).

float8 has 8 bits: E4M3 (`torch.float8_e4m3fn`, 3 mantissa bits, largest 448, no infinity) for
weights and activations, E5M2 (`torch.float8_e5m2`, 2 mantissa bits, largest 57344) for gradients
(Micikevicius et al., "FP8 Formats for Deep Learning", 2022, section 3). Its range is so short
that a tensor is cast with a scale s chosen so its largest magnitude lands on the format's
largest value:

    s = amax / fmax          (s = 1 where amax is 0)
    q = cast(saturate(x / s))   saturate: clamp to [-fmax, fmax] (E4M3 turns an overflow into NaN)
    x ~ q.float() * s        dequantized in float32, as a float8 matrix product accumulates in higher precision

Exercise 18.2's signature (`quantize_float8` is the reference):

    quantize_float8(x, dtype, block, amax=None) -> (q, scale)

`x` a 2-D float32 tensor of shape (m, n); `dtype` torch.float8_e4m3fn or torch.float8_e5m2;
`block` (bm, bn): one scale per bm x bn block, the blocks tiling x from its top-left corner (the
last row and column of blocks may be short). `block == x.shape` is one scale per tensor;
DeepSeek-V3 uses 1 x 128 tiles for activations and 128 x 128 blocks for weights (DeepSeek-AI,
"DeepSeek-V3 Technical Report", 2024, section 3.3.1). `amax`, if given, is a float32 tensor of
the scales' shape holding the magnitude to scale each block by (a delayed history's, see
`AmaxHistory`) instead of the block's own: values beyond it saturate. Returns `q` (m, n) in
`dtype` and `scale` (ceil(m / bm), ceil(n / bn)) float32, a new tensor each; `x` is unchanged.

Delayed scaling (Transformer Engine's recipe) takes amax from the last steps' history, so the
cast needs no pass over the tensor before it: `AmaxHistory`.
"""

from __future__ import annotations

import math

import torch

from ..runtime.reference import reference

#: The float8 formats torch casts to on the CPU.
FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def fmax(dtype: torch.dtype) -> float:
    """The format's largest finite value (448 for E4M3, 57344 for E5M2)."""
    if dtype not in FORMATS:
        raise ValueError(f"not a float8 format: {dtype}; use torch.float8_e4m3fn or torch.float8_e5m2")
    return float(torch.finfo(dtype).max)


def grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scales' shape: (ceil(m / bm), ceil(n / bn))."""
    if len(shape) != 2 or len(block) != 2 or min(block) < 1:
        raise ValueError(f"need a 2-D tensor and a block (bm, bn) of positive sizes, got {shape} and {block}")
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Each block's scale repeated over its block, cropped to `shape`."""
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The largest magnitude of each block of x (float32, the scales' shape)."""
    rows, cols = grid(tuple(x.shape), block)
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32)
    padded[: x.shape[0], : x.shape[1]] = x.abs()
    return padded.view(rows, block[0], cols, block[1]).amax(dim=(1, 3))


@reference("quantize_float8")
def quantize_float8(
    x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int], amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x cast to float8 with one scale per block (see the module's docstring)."""
    top = fmax(dtype)
    if amax is None:
        amax = block_amax(x, block)
    if tuple(amax.shape) != grid(tuple(x.shape), block):
        raise ValueError(f"amax has shape {tuple(amax.shape)}, the blocks' grid is {grid(tuple(x.shape), block)}")
    scale = torch.where(amax > 0, amax.float() / top, torch.ones_like(amax, dtype=torch.float32))
    scaled = x.float() / expand(scale, (x.shape[0], x.shape[1]), block)
    return scaled.clamp(-top, top).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 values of a float8 tensor and its block scales: q.float() * scale."""
    return q.float() * expand(scale, (q.shape[0], q.shape[1]), block)


def cast_error(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> float:
    """Relative error of a cast, ||x - dequantized|| / ||x|| (0 for a zero tensor)."""
    norm = float(x.float().norm())
    return float((x.float() - dequantize(q, scale, block)).norm()) / norm if norm > 0 else 0.0


class AmaxHistory:
    """Delayed scaling: the amax to scale by is the largest of the last `length` steps' amaxes.

    `amax()` (one value per block; the tensor's own before any history) scales this step's cast;
    `record(x)` then adds this step's amax, dropping the oldest beyond `length`. A tensor that
    grows faster than its history saturates: the cast clamps it to fmax (NVIDIA, Transformer
    Engine documentation, "Using FP8 with Transformer Engine", delayed scaling)."""

    def __init__(self, block: tuple[int, int], length: int = 16):
        if length < 1:
            raise ValueError(f"an amax history keeps at least one step, got length={length}")
        self.block, self.length = block, length
        self.history: list[torch.Tensor] = []

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        """The amax to scale x by: the history's largest, or x's own before the first record."""
        if not self.history:
            return block_amax(x, self.block)
        return torch.stack(self.history).amax(dim=0)

    def record(self, x: torch.Tensor) -> None:
        """Add x's amax to the history."""
        self.history = [*self.history, block_amax(x, self.block)][-self.length :]

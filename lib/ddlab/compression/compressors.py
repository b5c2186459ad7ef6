"""Compressors for gradients: what a rank sends instead of its dense gradient.

Each `compress` returns a small message; `decompress` turns it back into a dense
vector of the same length. The error bounds the tests hold them to, for x of n items:

- `top_k(x, k)`: the k entries largest in magnitude. ||x - d||^2 <= (1 - k/n) ||x||^2.
- `random_k(x, k, rng)`: k entries chosen uniformly. ||x - d||^2 <= ||x||^2, and
  (1 - k/n) ||x||^2 on average. Unscaled, so biased: error feedback makes up for it.
- `quantize_8bit(x, rng)`: QSGD-style stochastic rounding (Alistarh et al., "QSGD:
  communication-efficient SGD via gradient quantization and encoding", NeurIPS 2017)
  to 127 levels of max|x| per sign: unbiased, |x_i - d_i| <= max|x| / 127, one byte per item.
- `qsgd(x, s, rng)`: QSGD itself (Alistarh et al. 2017, Section 3.1): |x_i| / ||x||_2 rounded
  stochastically to one of s levels per sign, int8 levels and the 2-norm. Unbiased, and
  E||x - d||^2 <= min(n / s^2, sqrt(n) / s) ||x||^2 (their Lemma 3.1).
- `sign_1bit(x)`: the signs (one bit per item, packed) times mean|x| (1-bit SGD, Seide
  et al., Interspeech 2014; signSGD, Bernstein et al., ICML 2018). ||x - d||^2 =
  ||x||^2 - ||x||_1^2 / n <= ||x||^2: a contraction, so error feedback makes SGD with it
  converge (Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
  Compression Schemes", ICML 2019; for top-k and random-k, Stich et al., "Sparsified SGD
  with Memory", NeurIPS 2018; both prove it for SGD without momentum).

`ErrorFeedback` keeps the residual, what compression left out, and adds it to the
next gradient: e_{t+1} = (g_t + e_t) - d_t, so sum of d_t + e_T = sum of g_t exactly.

Exercise signatures (lab 11):
`qsgd(x, s, rng) -> (norm, levels)` and `unqsgd(norm, levels, s) -> x's estimate`: see `qsgd`.
`top_k_with_feedback(gradient, residual, k) -> (indices, values, residual)`: top-k of
gradient + residual, `indices` int32, `values` the gradient's dtype, and the new residual
(what was not sent); the gradient is left unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..runtime.reference import reference

#: The dtype of the indices a sparse message carries (4 bytes each).
INDEX = np.int32
#: Quantization levels per sign of the 8-bit quantizer.
LEVELS = 127


@dataclass(frozen=True)
class Sparse:
    """k (index, value) pairs of a vector of n items; the other items are zero."""

    indices: np.ndarray
    values: np.ndarray
    n: int

    @property
    def nbytes(self) -> int:
        return self.indices.nbytes + self.values.nbytes


@dataclass(frozen=True)
class Quantized:
    """Signed levels in -LEVELS..LEVELS (one byte each) and the scale max|x| (a float)."""

    levels: np.ndarray
    scale: np.ndarray  # shape (1,), the input's dtype

    @property
    def nbytes(self) -> int:
        return self.levels.nbytes + self.scale.nbytes


@dataclass(frozen=True)
class Signs:
    """Signs packed eight to a byte and the scale mean|x|."""

    bits: np.ndarray
    scale: np.ndarray  # shape (1,), the input's dtype
    n: int

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes + self.scale.nbytes


def keep_count(n: int, density: float) -> int:
    """How many of n items a sparsifier of `density` (0 < density <= 1) keeps: at least one if n > 0."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return min(n, max(1, round(density * n))) if n else 0


def top_k(x: np.ndarray, k: int) -> Sparse:
    """The k entries of x largest in magnitude, indices ascending."""
    if not 0 <= k <= x.size:
        raise ValueError(f"k must be between 0 and len(x) = {x.size}, got {k}")
    chosen = np.argpartition(np.abs(x), x.size - k)[x.size - k :] if k else np.empty(0, dtype=np.intp)
    chosen = np.sort(chosen).astype(INDEX)
    return Sparse(chosen, x[chosen], x.size)


def random_k(x: np.ndarray, k: int, rng: np.random.Generator) -> Sparse:
    """k entries of x chosen uniformly without replacement, indices ascending."""
    if not 0 <= k <= x.size:
        raise ValueError(f"k must be between 0 and len(x) = {x.size}, got {k}")
    chosen = np.sort(rng.choice(x.size, size=k, replace=False)).astype(INDEX)
    return Sparse(chosen, x[chosen], x.size)


def densify(message: Sparse) -> np.ndarray:
    """The dense vector a sparse message stands for."""
    out = np.zeros(message.n, dtype=message.values.dtype)
    out[message.indices] = message.values
    return out


def quantize_8bit(x: np.ndarray, rng: np.random.Generator) -> Quantized:
    """Stochastic rounding of |x| / max|x| to LEVELS levels: E[decompress] = x."""
    scale = np.abs(x).max(initial=0).astype(x.dtype)
    if scale == 0:
        return Quantized(np.zeros(x.size, dtype=np.int8), np.array([scale]))
    level = np.minimum(stochastic_round(np.abs(x) / scale * LEVELS, rng), LEVELS)
    return Quantized((np.sign(x) * level).astype(np.int8), np.array([scale]))


def dequantize_8bit(message: Quantized) -> np.ndarray:
    """The vector the levels stand for: level * scale / LEVELS."""
    return message.levels.astype(message.scale.dtype) * (message.scale[0] / LEVELS)


def stochastic_round(ratio: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """floor(ratio) or floor(ratio) + 1, the latter with probability ratio - floor(ratio): E = ratio."""
    return np.floor(ratio + rng.random(ratio.size))


@reference("qsgd")
def qsgd(x: np.ndarray, s: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """QSGD with s levels per sign: (norm, levels), norm = [||x||_2] in x's dtype, levels int8 in -s..s.

    |levels_i| is floor(s |x_i| / ||x||) or one more, with the probability that makes
    E[unqsgd(norm, levels, s)] = x. A zero vector gives norm 0 and zero levels; x is not changed.
    """
    if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) or not 1 <= s <= LEVELS:
        raise ValueError(f"s (levels per sign) must be an int from 1 to {LEVELS}, to fit in int8; got {s!r}")
    if x.ndim != 1 or x.dtype.kind != "f":
        raise ValueError(f"x must be a 1-D float array, got {x.ndim}-D {x.dtype}")
    norm = np.array([np.linalg.norm(x)], dtype=x.dtype)
    if norm[0] == 0:
        return norm, np.zeros(x.size, dtype=np.int8)
    level = np.minimum(stochastic_round(np.abs(x) / norm[0] * s, rng), s)
    return norm, (np.sign(x) * level).astype(np.int8)


@reference("qsgd")
def unqsgd(norm: np.ndarray, levels: np.ndarray, s: int) -> np.ndarray:
    """The vector QSGD's message stands for, in the norm's dtype: norm * levels / s."""
    return levels.astype(norm.dtype) * (norm[0] / norm.dtype.type(s))


def bias_and_error(
    compress: Callable[[np.ndarray, np.random.Generator], np.ndarray], x: np.ndarray, draws: int, seed: int = 0
) -> tuple[float, float]:
    """Over `draws` calls of compress(x, rng) -> dense estimate: ||E[d] - x|| / ||x|| and E||d - x||^2 / ||x||^2."""
    rng = np.random.default_rng(seed)
    total, squared = np.zeros(x.size), 0.0
    for _ in range(draws):
        d = compress(x, rng).astype(np.float64)
        total += d
        squared += float(np.sum((d - x) ** 2))
    norm2 = float(np.sum(x.astype(np.float64) ** 2))
    return float(np.linalg.norm(total / draws - x)) / np.sqrt(norm2), squared / draws / norm2


def sign_1bit(x: np.ndarray) -> Signs:
    """One bit per item (1 for x >= 0) and the scale mean|x|."""
    scale = np.array([np.abs(x).mean() if x.size else 0], dtype=x.dtype)
    return Signs(np.packbits(x >= 0), scale, x.size)


def unsign_1bit(message: Signs) -> np.ndarray:
    """The vector the signs stand for: +-scale."""
    signs = np.unpackbits(message.bits, count=message.n).astype(message.scale.dtype)
    return (2 * signs - 1) * message.scale[0]


@reference("top_k_with_feedback")
def top_k_with_feedback(
    gradient: np.ndarray, residual: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One step of top-k with error feedback: (indices, values) to send and the new residual."""
    fed = gradient + residual
    message = top_k(fed, k)
    return message.indices, message.values, fed - densify(message)


@reference("top_k_with_feedback")
class ErrorFeedback:
    """The residual of one gradient vector: what was computed but not yet sent.

    `feed(g)` returns g + residual, what to compress this step; `keep(fed, sent)` then
    stores fed - sent, the part compression left out, for the next step.
    """

    def __init__(self) -> None:
        self.residual: np.ndarray | None = None

    def feed(self, gradient: np.ndarray) -> np.ndarray:
        if self.residual is None or self.residual.shape != gradient.shape:
            self.residual = np.zeros_like(gradient)
        return gradient + self.residual

    def keep(self, fed: np.ndarray, sent: np.ndarray) -> None:
        self.residual = fed - sent

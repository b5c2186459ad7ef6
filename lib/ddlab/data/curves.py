"""Synthetic tensile tests: 200-point stress-strain curves -> two material parameters.

The task after a common one in materials science: from a measured stress-strain
curve, infer the parameters of a constitutive law. Each sample is a tensile test of
a metal following elastic loading and Swift's hardening law (H. W. Swift, "Plastic
instability under plane stress", J. Mech. Phys. Solids, 1952),

    stress = E * strain                                   below the yield strain s_y / E
    stress = s_y * (1 + (strain - s_y / E) / e_0) ** n    above it,

recorded at 200 strains up to the test's last strain. The specimen breaks at a
fracture strain; from there on the stress reads 0 and the flag is 0 (1 while
intact). Stress carries measurement noise. A network sees (strain, stress, flag)
and predicts the yield strength s_y and the hardening exponent n; Young's modulus
E, the pre-strain e_0, the fracture strain and the test length vary too, as nuisances.

Samples are made on demand from (seed, index) with a counter-based hash, so any
rank can make any sample, the same everywhere, without storing the data set: a
data set of 10^5 or 10^8 samples costs no memory, and making a batch is real work
that shows up as "data" time in profiles.
"""

from __future__ import annotations

import numpy as np
import torch

N_POINTS = 200
#: Features per sample: strain, stress and flag, 200 points each, channel after channel.
N_FEATURES = 3 * N_POINTS

# Ranges of the sampled quantities (uniform). Stress in MPa, strain dimensionless.
YOUNG = (60e3, 220e3)
YIELD = (150.0, 600.0)
HARDENING_EXPONENT = (0.1, 0.5)
PRESTRAIN = (0.002, 0.02)
FRACTURE_STRAIN = (0.05, 0.35)
LAST_STRAIN = (0.2, 0.3)
# Scales that bring the inputs near [0, 1].
STRAIN_SCALE, STRESS_SCALE = 0.3, 1500.0

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# One stream of random numbers per quantity, so they are independent.
_E, _SY, _N, _E0, _EF, _LAST, _NOISE = range(7)


def _mix(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijection of uint64 that scrambles every bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _bits(seed: int, counters: np.ndarray, stream: int) -> np.ndarray:
    """64 random bits per counter, a pure function of (seed, stream, counter)."""
    key = _mix(np.array([seed * 16 + stream], dtype=np.uint64) * _GOLDEN + np.uint64(1))
    return _mix(counters.astype(np.uint64) * _GOLDEN ^ key)


def _uniform(seed: int, counters: np.ndarray, stream: int) -> np.ndarray:
    """Uniform numbers in (0, 1), one per counter."""
    return ((_bits(seed, counters, stream) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def _normal(seed: int, counters: np.ndarray, stream: int) -> np.ndarray:
    """Nearly standard normal numbers, one per counter: the sum of four 16-bit uniforms, rescaled.

    (Irwin-Hall: cheaper than Box-Muller's logarithm and cosine, and plenty for noise.)
    """
    bits, mask = _bits(seed, counters, stream), np.uint64(0xFFFF)
    total = sum(((bits >> np.uint64(16 * k)) & mask).astype(np.float64) for k in range(4))
    return (total / 65536.0 - 2.0) * np.sqrt(3.0)


def _scaled(u: np.ndarray, bounds: tuple[float, float]) -> np.ndarray:
    low, high = bounds
    return low + (high - low) * u


class StressStrainCurves:
    """A deterministic data set of n tensile tests, made on demand.

    `data[indices]` returns (x, y): x of shape (len(indices), 600), the strain, stress
    and flag channels scaled to about [0, 1]; y of shape (len(indices), 2), the yield
    strength and hardening exponent scaled to [-1, 1] (`physical_targets` undoes it).
    """

    def __init__(self, n: int = 100_000, seed: int = 0, noise: float = 0.02, dtype: torch.dtype = torch.float32):
        if n < 1:
            raise ValueError(f"a data set needs at least one sample, got n={n}")
        self.n, self.seed, self.noise, self.dtype = int(n), int(seed), float(noise), dtype

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"StressStrainCurves(n={self.n}, seed={self.seed}, noise={self.noise}, dtype={self.dtype})"

    def _indices(self, index: int | slice | np.ndarray | list[int]) -> np.ndarray:
        if isinstance(index, slice):
            return np.arange(self.n)[index]
        idx = np.atleast_1d(np.asarray(index, dtype=np.int64))
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"indices must lie in [0, {self.n}), got {idx.min()}..{idx.max()}")
        return idx

    def parameters(self, index: int | slice | np.ndarray | list[int]) -> dict[str, np.ndarray]:
        """The physical parameters of the samples (MPa for stresses)."""
        idx = self._indices(index)
        draw = lambda stream, bounds: _scaled(_uniform(self.seed, idx, stream), bounds)  # noqa: E731
        return {
            "young": draw(_E, YOUNG),
            "yield": draw(_SY, YIELD),
            "exponent": draw(_N, HARDENING_EXPONENT),
            "prestrain": draw(_E0, PRESTRAIN),
            "fracture": draw(_EF, FRACTURE_STRAIN),
            "last": draw(_LAST, LAST_STRAIN),
        }

    def curves(self, index: int | slice | np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(strain, stress in MPa, flag), each of shape (samples, 200), unscaled."""
        idx = self._indices(index)
        p = self.parameters(idx)
        strain = p["last"][:, None] * np.linspace(0.0, 1.0, N_POINTS)[None, :]
        yield_strain = (p["yield"] / p["young"])[:, None]
        plastic = np.maximum(strain - yield_strain, 0.0)
        stress = np.where(
            strain <= yield_strain,
            p["young"][:, None] * strain,
            p["yield"][:, None] * (1.0 + plastic / p["prestrain"][:, None]) ** p["exponent"][:, None],
        )
        counters = idx[:, None] * N_POINTS + np.arange(N_POINTS)[None, :]
        gaussian = _normal(self.seed, counters, _NOISE)
        flag = (strain <= p["fracture"][:, None]).astype(np.float64)
        stress = (stress + self.noise * p["yield"][:, None] * gaussian) * flag
        return strain, stress, flag

    def targets(self, index: int | slice | np.ndarray | list[int]) -> np.ndarray:
        """The scaled targets, in [-1, 1], as a float64 array of shape (samples, 2)."""
        p = self.parameters(index)
        return np.stack(
            [
                2 * (p["yield"] - YIELD[0]) / (YIELD[1] - YIELD[0]) - 1,
                2 * (p["exponent"] - HARDENING_EXPONENT[0]) / (HARDENING_EXPONENT[1] - HARDENING_EXPONENT[0]) - 1,
            ],
            axis=1,
        )

    def __getitem__(self, index: int | slice | np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self._indices(index)
        strain, stress, flag = self.curves(idx)
        x = np.concatenate([strain / STRAIN_SCALE, stress / STRESS_SCALE, flag], axis=1)
        return torch.as_tensor(x, dtype=self.dtype), torch.as_tensor(self.targets(idx), dtype=self.dtype)


def physical_targets(y: torch.Tensor | np.ndarray) -> np.ndarray:
    """Scaled targets (or predictions) back in physical units: (yield strength MPa, exponent)."""
    y = np.asarray(y.detach() if isinstance(y, torch.Tensor) else y, dtype=np.float64)
    low = np.array([YIELD[0], HARDENING_EXPONENT[0]])
    high = np.array([YIELD[1], HARDENING_EXPONENT[1]])
    return low + (y + 1) / 2 * (high - low)

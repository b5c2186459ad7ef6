"""The model every mode trains: least squares on seeded data, in float64, so runs compare exactly."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class LeastSquares:
    """Fit w to y = X w_true + noise; worker k's batch at step t depends only on (seed, k, t)."""

    n: int = 16  # parameters
    samples: int = 512
    batch: int = 16
    seed: int = 0
    X: np.ndarray = field(init=False, repr=False)
    y: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.X = rng.standard_normal((self.samples, self.n))
        self.y = self.X @ rng.standard_normal(self.n) + 0.1 * rng.standard_normal(self.samples)

    def start(self) -> np.ndarray:
        """The parameters every mode starts from."""
        return np.zeros(self.n)

    def gradient(self, w: np.ndarray, worker: int, step: int) -> np.ndarray:
        """Gradient of the mean squared error on worker's batch for step."""
        rows = np.random.default_rng((self.seed, worker, step)).integers(0, self.samples, self.batch)
        X, y = self.X[rows], self.y[rows]
        return 2.0 * X.T @ (X @ w - y) / self.batch

    def loss(self, w: np.ndarray) -> float:
        """Mean squared error on all samples."""
        return float(np.mean((self.X @ w - self.y) ** 2))

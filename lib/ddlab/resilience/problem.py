"""The training problem lab 19's failures strike: least squares in float64, small enough to replay exactly.

`Regression` makes its data locally (no downloads) and gives what a data-parallel step needs: the
global batch of a step (`batch_ids`, the same on every rank, lab 12's plan of who reads what left
to the caller), the summed loss and gradient over any samples (`loss_and_grad`), the start point
and the learning rate, and `one_process(steps)`, the run every fault-tolerant run must equal.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Regression:
    """min_w mean over a step's batch of (x.w - y)^2 / 2, `samples` rows of `features` in float64."""

    samples: int = 240
    features: int = 6
    batch: int = 12
    lr: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.batch <= self.samples or self.features < 1:
            raise ValueError(
                f"need 0 < batch <= samples and features >= 1, got batch={self.batch}, samples={self.samples}, "
                f"features={self.features}"
            )

    @functools.cached_property
    def _data(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        x = rng.standard_normal((self.samples, self.features))
        w = rng.standard_normal(self.features)
        return x, x @ w + 0.1 * rng.standard_normal(self.samples)

    def initial(self) -> np.ndarray:
        """The parameters every run starts from (a new array)."""
        return np.zeros(self.features)

    def batch_ids(self, step: int) -> np.ndarray:
        """The `batch` sample ids of `step` (an epoch is a fresh permutation), the same on every rank."""
        per_epoch = self.samples // self.batch
        epoch, slot = divmod(step, per_epoch)
        order = np.random.default_rng((self.seed, epoch)).permutation(self.samples)
        return order[slot * self.batch : (slot + 1) * self.batch]

    def loss_and_grad(self, params: np.ndarray, ids: np.ndarray) -> tuple[float, np.ndarray]:
        """The SUM over samples `ids` of the loss, and of its gradient (divide both by `batch` for the mean)."""
        x, y = self._data
        rows = np.asarray(ids, dtype=np.int64)
        err = x[rows] @ params - y[rows]
        return float(0.5 * err @ err), x[rows].T @ err

    def one_process(self, steps: int) -> tuple[list[float], np.ndarray]:
        """The losses of `steps` SGD steps on one process, and the final parameters: what every run must equal."""
        params, losses = self.initial(), []
        for step in range(steps):
            loss, grad = self.loss_and_grad(params, self.batch_ids(step))
            losses.append(loss / self.batch)
            params = params - self.lr * grad / self.batch
        return losses, params

"""A straggler: one worker slower by a factor, the same one for the same seed."""

from __future__ import annotations

import numpy as np


def slowdowns(workers: int, factor: float = 1.0, seed: int = 0) -> np.ndarray:
    """Per-worker factors on compute time: all 1, except one seeded worker at `factor`."""
    if workers < 1:
        raise ValueError(f"need at least one worker, got {workers}")
    if factor < 1:
        raise ValueError(f"a straggler is slower: factor must be >= 1, got {factor}")
    slow = np.ones(workers)
    slow[np.random.default_rng(seed).integers(workers)] = factor
    return slow

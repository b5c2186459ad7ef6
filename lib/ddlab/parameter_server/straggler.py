"""Stragglers: one worker slower by a factor, the same one for the same seed; steady or transient.

`slowdowns` gives one factor per worker. `steady` and `transient` give one per worker and
step, with the same slow steps in all: a steady straggler takes every one of them itself,
a transient one is a different seeded worker for each spell of `spell` steps (Ho et al.,
NeurIPS 2013, made the stale-synchronous bound for the second kind).
"""

from __future__ import annotations

import numpy as np


def _check(workers: int, steps: int, factor: float) -> None:
    if workers < 1 or steps < 1:
        raise ValueError(f"need at least one worker and one step, got {workers} workers, {steps} steps")
    if factor < 1:
        raise ValueError(f"a straggler is slower: factor must be >= 1, got {factor}")


def slowdowns(workers: int, factor: float = 1.0, seed: int = 0) -> np.ndarray:
    """Per-worker factors on compute time: all 1, except one seeded worker at `factor`."""
    _check(workers, 1, factor)
    slow = np.ones(workers)
    slow[np.random.default_rng(seed).integers(workers)] = factor
    return slow


def steady(workers: int, steps: int, factor: float, seed: int = 0) -> np.ndarray:
    """Factors per (worker, step): the seeded worker of `slowdowns` at `factor` at every step."""
    _check(workers, steps, factor)
    return np.repeat(slowdowns(workers, factor, seed)[:, None], steps, axis=1)


def transient(workers: int, steps: int, factor: float, spell: int = 1, seed: int = 0) -> np.ndarray:
    """Factors per (worker, step): for each spell of `spell` steps, one seeded worker at `factor`, the rest 1."""
    _check(workers, steps, factor)
    if spell < 1:
        raise ValueError(f"a spell lasts at least one step, got {spell}")
    slow = np.ones((workers, steps))
    spells = -(-steps // spell)
    who = np.random.default_rng(seed).integers(workers, size=spells)
    for i, k in enumerate(who):
        slow[k, i * spell : (i + 1) * spell] = factor
    return slow

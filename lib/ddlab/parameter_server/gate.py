"""Consistency modes, and the stale-synchronous gate that tells a worker whether it may go on."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..runtime.reference import reference


@dataclass(frozen=True)
class Consistency:
    """How a server applies gradients: `bound` s of staleness (0, k or inf), averaged per step or not.

    synchronous: s = 0 and the average of every worker's step-t gradient is applied once;
    asynchronous: s = inf, each gradient applied on arrival; stale-synchronous: s = k.
    """

    bound: float
    average: bool = False

    @classmethod
    def parse(cls, mode: str) -> Consistency:
        """ "sync", "async" or "ssp<k>" (e.g. "ssp2")."""
        if mode == "sync":
            return cls(0, average=True)
        if mode == "async":
            return cls(math.inf)
        if mode.startswith("ssp") and mode[3:].isdigit():
            return cls(int(mode[3:]))
        raise ValueError(f"unknown consistency mode {mode!r}: use 'sync', 'async' or 'ssp<k>' such as 'ssp2'")


@reference("ssp_gate")
def may_start(clocks: np.ndarray, step: int, bound: float) -> bool:
    """Exercise 10.1: may a worker start `step` when the running workers have finished `clocks` steps?

    A worker may be at most `bound` steps ahead of the slowest: step t may start
    once every running worker has finished step t - bound (clocks.min() >= t - bound).
    """
    return len(clocks) == 0 or step - int(np.min(clocks)) <= bound

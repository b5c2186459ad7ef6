"""A stale-synchronous run replayed on a clock: when each gradient arrives, and the parameters it makes.

Worker k's step t computes for delay[k, t] units of time. The server applies each
gradient on arrival (rate lr / workers), and a waiting worker starts its next step as
soon as the gate allows (`may_start` with bound s: 0 is BSP, inf asynchronous); messages
take no time. No real clock and no MPI, so the same schedule gives the same run and the
bounds compare exactly. Exercise 10.3's check replays its schedule to know what the
student's server must do; lab 10 replays steady and transient stragglers side by side
(`compare_bounds`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .gate import may_start
from .problem import LeastSquares


@dataclass
class Replay:
    """What the server did, in the order it did it."""

    order: list[tuple[int, int]]  # (worker, step) of each update, in arrival order
    released: dict[tuple[int, int], int]  # (worker, step) -> updates applied when the worker started it
    history: list[np.ndarray]  # the parameters after 0, 1, 2, ... updates
    times: list[float]  # when each update arrived

    @property
    def staleness(self) -> list[int]:
        """Per update: the updates applied between its worker's start of the step and its arrival."""
        return [i - self.released[k, t] for i, (k, t) in enumerate(self.order)]


def replay(problem: LeastSquares, delay: np.ndarray, bound: float, lr: float, updates: int | None = None) -> Replay:
    """Replay workers computing for delay[k, t] under staleness bound s, up to `updates` updates (default: all)."""
    delay = np.asarray(delay, dtype=float)
    if delay.ndim != 2 or delay.size == 0 or np.any(delay <= 0):
        raise ValueError(f"delay must be a (workers, steps) array of positive durations, got shape {delay.shape}")
    workers, steps = delay.shape
    if updates is not None and not 0 <= updates <= delay.size:
        raise ValueError(f"updates must lie in 0..{delay.size} (workers x steps), got {updates}")
    if not (bound >= 0 and (bound == math.inf or float(bound).is_integer())):
        raise ValueError(f"bound must be a whole number of steps >= 0 or math.inf, got {bound}")
    wanted = delay.size if updates is None else updates
    clock = np.zeros(workers, dtype=np.int64)
    waiting, finish, now = set(range(workers)), {}, 0.0
    run = Replay([], {}, [problem.start()], [])
    while len(run.order) < wanted:
        for k in sorted(waiting):
            if may_start(clock[clock < steps], int(clock[k]), bound):
                waiting.discard(k)
                run.released[k, int(clock[k])] = len(run.order)
                finish[k] = now + delay[k, clock[k]]
        k = min(finish, key=finish.__getitem__)
        now, step = finish.pop(k), int(clock[k])
        run.order.append((k, step))
        run.times.append(now)
        gradient = problem.gradient(run.history[run.released[k, step]], k, step)
        run.history.append(run.history[-1] - lr / workers * gradient)
        clock[k] += 1
        if clock[k] < steps:
            waiting.add(k)
    return run


@dataclass
class Comparison:
    """Staleness bounds compared under kinds of straggler, each figure a mean over seeds."""

    bounds: list[float]
    time: dict[str, np.ndarray]  # kind -> per bound, time to the updates
    loss: dict[str, np.ndarray]  # kind -> per bound, loss after them
    staleness: dict[str, np.ndarray]  # kind -> per bound, mean staleness of the updates
    best: float  # the lowest loss the problems allow

    def table(self) -> str:
        """One block per kind: time, loss and mean staleness against the bound."""
        names = ["async" if math.isinf(s) else f"s = {s:g}" for s in self.bounds]
        lines = [" " * 21 + "".join(f"{name:>8}" for name in names)]
        for kind in self.time:
            lines.append(f"{kind:>10}: time     " + "".join(f"{v:8.1f}" for v in self.time[kind]))
            lines.append(f"{'':>10}  loss     " + "".join(f"{v:8.4f}" for v in self.loss[kind]))
            lines.append(f"{'':>10}  staleness" + "".join(f"{v:8.2f}" for v in self.staleness[kind]))
        lines.append(f"lowest possible loss {self.best:.4f}")
        return "\n".join(lines)


def compare_bounds(
    kinds: dict[str, Callable[[int], np.ndarray]],
    problem: Callable[[int], LeastSquares],
    bounds: Sequence[float],
    lr: float,
    updates: int,
    seeds: Sequence[int],
) -> Comparison:
    """Replay each kind's delays (kinds[kind](seed)) on problem(seed) for every bound, up to `updates`; mean over seeds."""
    problems = [problem(seed) for seed in seeds]
    figures: dict[str, list[list[tuple[float, float, float]]]] = {}
    for kind, delays in kinds.items():
        figures[kind] = []
        for seed, p in zip(seeds, problems):
            runs = [replay(p, delays(seed), s, lr, updates) for s in bounds]
            figures[kind].append([(r.times[-1], p.loss(r.history[-1]), float(np.mean(r.staleness))) for r in runs])
    means = {kind: np.mean(values, axis=0) for kind, values in figures.items()}  # bound, (time, loss, staleness)
    best = float(np.mean([p.loss(np.linalg.lstsq(p.X, p.y, rcond=None)[0]) for p in problems]))
    return Comparison(
        list(bounds),
        {kind: m[:, 0] for kind, m in means.items()},
        {kind: m[:, 1] for kind, m in means.items()},
        {kind: m[:, 2] for kind, m in means.items()},
        best,
    )

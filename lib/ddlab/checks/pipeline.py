"""Checks for lab 07: the GPipe and 1F1B schedules, and the PipeDream partition.

The schedules are compared op by op with the reference for every stage of 1 to 6
stages and 1 to 9 micro-batches, then run on a simulated pipeline, which catches
orders that deadlock. The partition is compared with the best split found by
trying them all, on stage-time functions with and without message costs.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, Callable

from ..pipeline import gpipe, in_flight, one_f_one_b, simulate
from ._core import CheckFailed

HINTS = {
    "gpipe": "GPipe runs the forwards of micro-batches 0..M-1, then their backwards in the same order.",
    "one_f_one_b": ("Stage s first runs min(K-s-1, M) forwards (the warm-up), then alternates one forward "
                    "and one backward (F, B, F, B, ... taking micro-batches in order), then runs the "
                    "backwards still missing."),
}


def _show(ops: Any, limit: int = 12) -> str:
    """'F0 F1 B0 ...' for a list of ops."""
    if not isinstance(ops, list):
        return repr(ops)
    parts = [f"{op[0]}{op[1]}" if isinstance(op, tuple) and len(op) == 2 else repr(op) for op in ops[:limit]]
    return " ".join(parts) + (" ..." if len(ops) > limit else "")


def _check_schedule(fn: Callable[[int, int, int], list], reference: Callable[[int, int, int], list]) -> None:
    name = reference.__name__
    for k in range(1, 7):
        for m in range(1, 10):
            got_all = []
            for stage in range(k):
                got = fn(k, m, stage)
                want = reference(k, m, stage)
                got_list = [tuple(op) for op in got] if isinstance(got, (list, tuple)) else got
                if got_list != want:
                    first = next((i for i, (a, b) in enumerate(zip(got_list, want)) if a != b),
                                 min(len(got_list), len(want))) if isinstance(got_list, list) else 0
                    raise CheckFailed(
                        f"{name}(k={k}, m={m}, stage={stage}) returned {_show(got_list)}\n"
                        f"expected                             {_show(want)}\n"
                        f"(first difference at position {first}). {HINTS[name]}"
                    )
                got_all.append(got_list)
            simulate(got_all)  # a deadlock here would be a bug in the reference
    print(f"passed: {name} gives every stage the reference order of forwards and backwards "
          f"(at most {in_flight(reference(4, 8, 0))} micro-batches in flight on stage 0 of 4 with M=8)")


def check_gpipe(fn: Callable[[int, int, int], list]) -> None:
    """fn(k, m, stage) must list GPipe's ops for that stage: [("F", 0), ..., ("B", m-1)]."""
    _check_schedule(fn, gpipe)


def check_one_f_one_b(fn: Callable[[int, int, int], list]) -> None:
    """fn(k, m, stage) must list 1F1B's ops for that stage (warm-up, steady state, cool-down)."""
    _check_schedule(fn, one_f_one_b)


def _brute_force(n: int, k: int, stage_time: Callable[[int, int], float]) -> tuple[float, list[int]]:
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        worst = max(stage_time(a, b) for a, b in zip(bounds, bounds[1:]))
        if best is None or worst < best[0]:
            best = (worst, bounds)
    assert best is not None, "k must be between 1 and n"
    return best


def _cases() -> list[tuple[int, int, Callable[[int, int], float], str]]:
    rng = random.Random(7)
    cases: list[tuple[int, int, Callable[[int, int], float], str]] = []
    for trial in range(30):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        compute = [round(rng.uniform(0.1, 5.0), 2) for _ in range(n)]
        cut = [0.0] * (n + 1)
        label = f"compute={compute}"
        if trial % 2:
            cut[1:-1] = [round(rng.uniform(0, 3.0), 2) for _ in range(n - 1)]
            label += f", plus a message cost {cut[1:-1]} at each cut"

        def stage_time(a: int, b: int, compute: list[float] = compute, cut: list[float] = cut) -> float:
            return sum(compute[a:b]) + cut[a] + cut[b]
        cases.append((n, k, stage_time, label))
    return cases


def check_pipedream_partition(fn: Callable[[int, int, Callable[[int, int], float]], Any]) -> None:
    """fn(n, k, stage_time) must return bounds of k contiguous stages minimising the largest stage_time."""
    for n, k, stage_time, label in _cases():
        got = fn(n, k, stage_time)
        best, want = _brute_force(n, k, stage_time)
        case = f"n={n}, k={k}, {label}"
        if not isinstance(got, (list, tuple)) or not all(isinstance(b, int) for b in got):
            raise CheckFailed(f"{case}: got {got!r}; return a list of k+1 ints (the stage bounds)")
        got = list(got)
        if len(got) != k + 1 or got[0] != 0 or got[-1] != n or any(a >= b for a, b in zip(got, got[1:])):
            raise CheckFailed(f"{case}: bounds {got} are not {k} contiguous non-empty stages of {n} layers "
                              f"(k+1 increasing ints from 0 to {n}, e.g. {want})")
        times = [round(stage_time(a, b), 3) for a, b in zip(got, got[1:])]
        if max(times) > best + 1e-9:
            raise CheckFailed(
                f"{case}: bounds {got} give stage times {times}, the slowest {max(times):g}; "
                f"bounds {want} make the slowest {best:g}. Fill best[s][j] (layers 0..j-1 in s stages) "
                f"for every s and j from best[s-1][i] and stage_time(i, j), then walk the best cuts back from (k, n)."
            )
    print("passed: pipedream_partition finds the split with the fastest slowest stage, messages included")

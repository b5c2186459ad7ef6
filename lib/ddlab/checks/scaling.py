"""Checks for lab 05 (scaling): efficiency, bucketed allreduce, learning-rate rules."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..scaling import efficiency, lr_factor
from ._core import array_problem, each_size, is_number, passed, run_counted
from ._draw import Draw, grading_draw, named
from .errors import CheckFailed

#: The arrays of the notebook's bucketed allreduce.
SHAPES = [(3, 4), (100,), (7,), (50, 2), (1,), (64,)]


def check_scaling_efficiency(fn: Callable[[dict[int, float], bool], dict[int, float]]) -> None:
    """fn(times, weak) -> {P: efficiency}: T(1)/(P T(P)) strong, T(1)/T(P) weak.

    The grader's draw: four sets of times for 1 and up to 5 other rank counts up to 1024, in any order."""
    draw = grading_draw(None, "scaling_efficiency")
    cases = [{1: 10.0, 2: 5.0, 4: 2.5}, {1: 8.0, 2: 6.0, 4: 5.0, 8: 4.5}, {1: 3.0}, {4: 1.0, 1: 2.0, 2: 1.5}]
    if draw is not None:
        cases = []
        for i in range(4):
            counts = [1, *draw.lengths(draw.integer(0, 5, "how many", i), 2, 1024, "counts", i)]
            seconds = draw.rng("times", i).uniform(0.01, 100.0, len(counts))
            cases.append({int(p): float(t) for p, t in zip(draw.rng("order", i).permutation(counts), seconds)})
    for times in cases:
        for weak in (False, True):
            got = fn(dict(times), weak)
            want = {p: efficiency(times[1], t, p, weak) for p, t in times.items()}
            if not isinstance(got, dict) or set(got) != set(want):
                raise CheckFailed(f"times {times}, weak={weak}: expected a dict with keys {sorted(want)}, got {got!r}")
            for p in want:
                if not math.isclose(got[p], want[p], rel_tol=1e-9):
                    formula = "T(1) / T(P)" if weak else "T(1) / (P * T(P))"
                    raise CheckFailed(
                        f"times {times}, weak={weak}: efficiency at P={p} is {got[p]:.4g}, expected "
                        f"{want[p]:.4g} = {formula}{named(draw)}"
                    )
    print(f"passed: scaling_efficiency for strong and weak scaling{named(draw)}")


def _expected_calls(sizes: list[int], itemsize: int, cap: float) -> list[int]:
    """Elements per allreduce for arrays of `sizes` packed greedily, in order, into buckets <= cap bytes."""
    calls: list[int] = []
    used = math.inf
    for size in sizes:
        nbytes = size * itemsize
        if calls and used + nbytes <= cap:
            calls[-1] += size
            used += nbytes
        else:
            calls.append(size)
            used = nbytes
    return calls


def _bucketed_problem(
    comm: MPI.Comm, fn: Callable[..., list[np.ndarray]], cap: float, timeout: float, shapes: list[tuple[int, ...]]
) -> str | None:
    """What is wrong on this rank after fn(comm, arrays, cap, allreduce), or None.

    The student's function gets a counting communicator that allows Allreduce under a
    timeout, so a rank that skips a bucket fails the check instead of hanging it."""
    rank, size = comm.Get_rank(), comm.Get_size()
    arrays = [np.arange(np.prod(s), dtype=np.float32).reshape(s) * (rank + 1) + i for i, s in enumerate(shapes)]
    originals = [a.copy() for a in arrays]
    calls: list[int] = []

    def allreduce(c: MPI.Comm, x: np.ndarray) -> np.ndarray:
        calls.append(int(x.size))
        out = np.empty_like(x)
        c.Allreduce(x, out, op=MPI.SUM)
        return out

    got, _ = run_counted(
        comm, fn, (arrays, cap, allreduce), f"allreduce_bucketed with cap {cap} bytes", timeout, allow=("Allreduce",)
    )
    want_calls = _expected_calls([int(np.prod(s)) for s in shapes], 4, cap)
    if not isinstance(got, list) or len(got) != len(arrays):
        return f"should return a list of {len(arrays)} arrays, got {type(got).__name__}"
    if not calls:
        return (
            "never called the `allreduce` passed as its last argument: sum each bucket with that function "
            "(the check counts its calls), not with comm.Allreduce or allreduce_mpi directly"
        )
    if calls != want_calls:
        return (
            f"allreduce calls of {calls} elements, expected {want_calls}: fill buckets in order, "
            f"starting a new one when the next array would pass {cap} bytes "
            "(an array larger than the cap travels alone)"
        )
    if any(not np.array_equal(a, o) for a, o in zip(arrays, originals)):
        return "the input arrays were changed: return new arrays"
    for i, (g, s) in enumerate(zip(got, shapes)):
        want = (np.arange(np.prod(s), dtype=np.float32).reshape(s) * size * (size + 1) / 2 + i * size).astype(
            np.float32
        )
        problem = array_problem(g, want, f"array {i} (shape {s}, the sum over ranks)")
        if problem is None and any(np.shares_memory(g, a) for a in arrays):
            problem = f"array {i} shares memory with an input array: return new arrays"
        if problem:
            return problem
    return None


def check_allreduce_bucketed(fn: Callable[..., list[np.ndarray]], timeout: float = 20.0) -> None:
    """fn(comm, arrays, cap_bytes, allreduce) sums each array over ranks, one allreduce per bucket;
    on 3 ranks (not a power of two) and on all."""
    world = MPI.COMM_WORLD
    sizes = sorted({min(3, world.Get_size()), world.Get_size()})
    draw = grading_draw(world, "allreduce_bucketed")
    shapes, caps = _bucket_cases(draw)

    def with_cap(cap: float) -> Callable[[MPI.Comm], str | None]:
        return lambda sub: _bucketed_problem(sub, fn, cap, timeout, shapes)

    drawn = "" if draw is None else f", arrays of shapes {shapes}{named(draw)}"
    for cap in caps:
        each_size(world, with_cap(cap), f"allreduce_bucketed with cap {cap} bytes{drawn}", sizes, draw=draw)
    passed(
        world,
        "allreduce_bucketed packs arrays into buckets in order and sums them, one allreduce per bucket, "
        f"on {' and '.join(map(str, sizes))} ranks{named(draw)}",
    )


def _bucket_cases(draw: Draw | None) -> tuple[list[tuple[int, ...]], list[float]]:
    """(the arrays' shapes, the caps in bytes): the notebook's, or 4 to 8 drawn shapes of 1 to 3 dimensions
    with caps 0, infinity, 3 drawn, and 2 that a bucket fills exactly (the float32 bytes of a run of arrays)."""
    if draw is None:  # 448 = 48 + 400 and 476 = 448 + 28: a bucket exactly full
        return SHAPES, [0, 16, 400, 448, 476, 1000, math.inf]
    count = draw.integer(4, 8, "arrays")
    shapes = [
        tuple(draw.integer(1, 12, "dim", i, d) for d in range(draw.integer(1, 3, "ndim", i))) for i in range(count)
    ]
    nbytes = [4 * math.prod(s) for s in shapes]
    full = [sum(nbytes[:2]), sum(nbytes[1:4])]
    return shapes, [0, *draw.lengths(3, 4, sum(nbytes), "caps"), *full, math.inf]


def check_lr_factor(fn: Callable[..., float]) -> None:
    """fn(step, k, rule, warmup_steps) equals ddlab.scaling.lr_factor.

    The grader's draw: k among 1 and 3 drawn up to 4096, warm-ups 0 and one up to 500, steps around it."""
    draw = grading_draw(None, "lr_factor")
    ks, warmups = [1, 4, 16], [0, 10]
    if draw is not None:
        ks, warmups = [1, *draw.lengths(3, 2, 4096, "k")], [0, draw.integer(1, 500, "warmup")]
    for rule in ("none", "linear", "sqrt"):
        for k in ks:
            for warmup in warmups:
                steps = (
                    (0, 1, 5, 9, 10, 50) if draw is None else sorted({0, 1, max(0, warmup - 1), warmup, 2 * warmup + 7})
                )
                for step in steps:
                    got, want = fn(step, k, rule, warmup), lr_factor(step, k, rule, warmup)
                    if not is_number(got) or not math.isclose(got, want, rel_tol=1e-9):
                        ramp = f", ramping up linearly from 1 over {warmup} steps" if warmup and step < warmup else ""
                        raise CheckFailed(
                            f"lr_factor(step={step}, k={k}, rule={rule!r}, warmup_steps={warmup}) "
                            f"returned {got!r}, expected {want:.4g}{ramp}{named(draw)}"
                        )
    print(f"passed: lr_factor gives the linear and square-root rules, with warm-up{named(draw)}")

"""Checks for lab 09: the data-parallel and spatial time and memory formulas.

The student's formula is compared with the reference (`ddlab.oracle.formulas`) on
generated cases: 1 to 9 ranks (one rank, two, odd and even counts), small and large
messages, fast and slow links, 1 to 4 convolutions. The functions are pure, so every
rank runs all cases; `each_size` gathers one verdict.
"""

from __future__ import annotations

import math
import random
from typing import Callable

from mpi4py import MPI

from ..oracle import formulas
from ._core import each_size, passed

HINTS = {
    "data_parallel_time": "each rank computes its share of the batch; the ring moves 2(P-1)/P of the gradient "
    "bytes in and out of every rank, in 2(P-1) messages.",
    "data_parallel_memory": "which of the four parts does every replica hold whole, and which one shrinks with P?",
    "spatial_time": "count the messages of the busiest rank: per convolution, forward and backward, one per "
    "neighbour it has; then the gradients' allreduce.",
    "spatial_memory": "a slab keeps halo rows only from the neighbours it has: edge slabs have one, inner slabs two.",
}


def _cases(name: str) -> list[tuple]:
    rng = random.Random(9)
    cases: list[tuple] = []
    for trial in range(40):
        p = [1, 2, 3, 4, 5, 8, 9][trial % 7]
        alpha, beta = 10 ** rng.uniform(-6, -4), 10 ** rng.uniform(-11, -8)
        compute, nbytes = rng.uniform(1e-3, 1.0), rng.choice([0, 4, 4096, 2**20, 10**8 + 4])
        halos = [float(rng.choice([64, 4096, 2**16])) for _ in range(1 + trial % 4)]
        if name == "data_parallel_time":
            cases.append((compute, nbytes, p, alpha, beta))
        elif name == "data_parallel_memory":
            cases.append((nbytes, rng.choice([1000, 2**24]), p, trial % 3))
        elif name == "spatial_time":
            cases.append((compute, halos, nbytes, p, alpha, beta))
        else:
            for rank in range(p):
                cases.append((nbytes, 2**20, halos, p, rank, trial % 3))
    return cases


def _problem(name: str, fn: Callable, case: tuple) -> str | None:
    want = getattr(formulas, name)(*case)
    got = fn(*case)
    if not isinstance(got, dict):
        return f"{name}{case} returned {type(got).__name__}; return a dict with keys {sorted(want)}"
    if set(got) != set(want):
        return f"{name}{case} returned keys {sorted(got)}; expected {sorted(want)}"
    for key, value in want.items():
        try:
            ok = math.isclose(float(got[key]), value, rel_tol=1e-9, abs_tol=1e-15)
        except (TypeError, ValueError):
            return f"{name}{case}[{key!r}] is {got[key]!r}, not a number"
        if not ok:
            return (
                f"{name}{case}[{key!r}] = {float(got[key]):.6g}, expected {value:.6g} "
                f"(ratio {float(got[key]) / value if value else float('inf'):.3g}). Hint: {HINTS[name]}"
            )
    return None


def _check(name: str, fn: Callable, comm: MPI.Comm | None) -> None:
    comm = comm or MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        for case in _cases(name):
            problem = _problem(name, fn, case)
            if problem:
                return problem
        return None

    each_size(comm, body, f"{name} differs from the reference", sizes=[comm.Get_size()])
    passed(comm, f"{name} agrees with the reference on {len(_cases(name))} generated cases (1 to 9 ranks)")


def check_data_parallel_time(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(compute, gradient_bytes, p, alpha, beta) -> {"compute", "communication"} (Exercise 9.1)."""
    _check("data_parallel_time", fn, comm)


def check_data_parallel_memory(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(parameter_bytes, activation_bytes, p, optimizer_copies) -> the four parts (Exercise 9.2)."""
    _check("data_parallel_memory", fn, comm)


def check_spatial_time(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(compute, halo_bytes, gradient_bytes, p, alpha, beta) -> {"compute", "communication"} (Exercise 9.3)."""
    _check("spatial_time", fn, comm)


def check_spatial_memory(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(parameter_bytes, activation_bytes, halo_bytes, p, rank, optimizer_copies) -> five parts (Exercise 9.4)."""
    _check("spatial_memory", fn, comm)

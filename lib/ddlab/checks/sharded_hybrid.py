"""Check for lab 13's hybrid sharding exercise: the two-stage gradient reduction of HSDP."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..runtime.counting import Traffic
from ._core import NOTHING_SENT, array_problem, each_size, fail_together, passed, run_counted
from ._draw import grading_draw, named
from .sharded import rank_hint

#: What the exercise may call besides point-to-point messages: the halves (MPI's, counted).
ALLOWED = ("Reduce_scatter", "Allgatherv")


def _reference(sub: MPI.Comm, x: np.ndarray, group_size: int) -> np.ndarray:
    """Shard rank % G of the sum over all ranks of x (x of G equal shards), from MPI's Allreduce."""
    total = np.empty_like(x)
    sub.Allreduce(x, total, op=MPI.SUM)
    s = x.size // group_size
    local = sub.Get_rank() % group_size
    return total[local * s : (local + 1) * s]


def _bytes_problem(traffic: list[Traffic], group_size: int, nbytes: int) -> str | None:
    """The bytes between groups and inside them, against two-stage reduction's (nbytes: one rank's x)."""
    size = len(traffic)
    replicas = size // group_size
    across = inside = 0
    for t in traffic:
        for e in t.sends:
            if e.peer // group_size != t.rank // group_size:
                across += e.nbytes
            else:
                inside += e.nbytes
    most_across = 2 * (replicas - 1) * nbytes  # the shards' allreduce across groups: 2 (R-1) N b
    most_inside = replicas * (group_size - 1) * nbytes  # one reduce-scatter in each group: R (G-1) N b
    if size > 1 and across + inside == 0:
        return NOTHING_SENT
    if across > most_across:
        return (
            f"{across} bytes crossed between groups, more than the {most_across} of two-stage reduction "
            "(2 (R-1) N b: only each rank's shard, allreduced among the R ranks holding it): reduce-scatter "
            "inside the group first, then reduce the shard across groups, not the whole gradient"
        )
    if inside > most_inside:
        return (
            f"{inside} bytes moved inside the groups, more than the {most_inside} of one reduce-scatter "
            "per group (R (G-1) N b)"
        )
    unfreed = sum(t.unfreed for t in traffic)
    if unfreed > 0:
        return (
            f"{unfreed} communicators made with Split were not freed (all ranks together): call .Free() on each "
            "group communicator once its messages are done (MPI can hold only so many)"
        )
    return None


def check_hybrid_reduce_scatter(fn: Callable[[Any, np.ndarray, int], np.ndarray], timeout: float = 20.0) -> None:
    """fn(comm, x, group_size) -> new array: shard (rank % G) of the sum over all ranks of x.

    Ranks form groups of G = group_size consecutive ranks; x (float64 or float32, the same
    length on every rank) is G equal shards. Point-to-point messages, MPI's Reduce_scatter and
    Allgatherv (counted) and Split (each communicator freed); no more bytes between groups than the shard's allreduce
    across them, no more inside a group than one reduce-scatter. x is left alone. Each call is done
    within `timeout` seconds.

    The grader's draw: the ranks of each communicator (any of the world's, in any order), two shard lengths
    (1 to 12) for each group size and the data; every group size dividing the ranks, float64 and float32.
    """
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "hybrid_reduce_scatter")

    def body(sub: MPI.Comm) -> str | None:
        size = sub.Get_size()
        hint = rank_hint(sub, comm, draw)  # each_size's last run: rank q is world rank q - 1
        for g in [g for g in range(1, size + 1) if size % g == 0]:
            for shard in (5, 1) if draw is None else draw.lengths(2, 1, 12, "shards", size, g):
                for dtype in (np.float64, np.float32):
                    n = g * shard
                    context = f"hybrid_reduce_scatter (groups of {g}, {g} shards of {shard}, {np.dtype(dtype).name}"
                    keys = [n, sub.Get_rank(), g]
                    if draw is not None:
                        seed = draw.data_seed(size, g, shard, np.dtype(dtype).name)
                        context += f", data seed {seed}{named(draw)}"
                        keys.append(seed)
                    context += ")"
                    x = np.random.default_rng(keys).standard_normal(n).astype(dtype)
                    kept = x.copy()
                    got, traffic = run_counted(sub, fn, (x, g), context, timeout=timeout, allow=ALLOWED)
                    want = _reference(sub, kept, g)
                    rtol = 1e-5 if dtype == np.float32 else 1e-10
                    problem = array_problem(got, want, "the summed shard", rtol=rtol, atol=rtol)
                    if problem is None and not np.array_equal(x, kept):
                        problem = "x was changed: leave the caller's gradient alone and return a new array"
                    if problem is None and np.shares_memory(got, x):
                        problem = "the result shares memory with x: return a new array"
                    found = problem or _bytes_problem(traffic, g, n * np.dtype(dtype).itemsize)
                    fail_together(sub, found and f"{context}: {found}", "hybrid_reduce_scatter", hint)
        return None

    size = comm.Get_size()
    each_size(comm, body, "hybrid_reduce_scatter", sizes=[size, *range(1, size)], reordered=True, draw=draw)
    passed(
        comm,
        "hybrid_reduce_scatter: every group size, float64 and float32, the sum over all ranks in a new array, "
        f"with no more bytes between groups than the shard's allreduce{named(draw)}",
    )

"""Checks for lab 15 (experts): the MoE dispatch (counts by Alltoall, rows by Alltoallv) and combine.

Both run on the whole world first (an answer on the notebook's communicator is seen there), then on
sub-communicators of 1 .. P-1 ranks; all ranks agree on each case's verdict before the next case.
Both hand the student's function a CountingComm that allows exactly the collectives the
lab names, on sub-communicators of every size, and compare with what one process
computes from every rank's rows (each rank can make every rank's rows from its seed):

- `check_dispatch`: the rows received (grouped by source, then by local expert, then
  in the sender's order) and the (P, E/P) int64 counts; exactly one Alltoall of the
  counts (E/P int64 to every rank) and then one Alltoallv of exactly the rows each
  rank's experts take; x left as it was.
- `check_combine`: out[i] is the result for this rank's row i (the inverse
  permutation), carried by one Alltoallv of exactly the rows each rank gets back.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..runtime.counting import COLLECTIVE_TAG, Traffic
from ._core import array_problem, count, each_size, fail_together, passed, run_counted

#: (dtype, shape of one row after the first axis, experts per rank or None for 12 in all, skew, last rank empty):
#: rank r holds 5 + 3 r rows (the last rank none, if so marked), routed with a skew towards the first experts.
CASES = (("float64", (3,), None, 1.0, False), ("float32", (2, 2), 1, 0.0, False), ("int64", (), None, 2.0, True))


def _experts(case: tuple, size: int) -> int:
    per_rank = case[2]
    return 12 if per_rank is None else per_rank * size


def _rows(case: tuple, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank's rows and their experts: row i of rank r reads 1000 r + i (+ an eighth per feature), so a mix-up shows."""
    dtype, shape, _, skew, last_empty = case
    n = 0 if last_empty and rank == size - 1 and size > 1 else 5 + 3 * rank
    experts = _experts(case, size)
    weights = np.exp(-skew * np.arange(experts) / experts)
    rng = np.random.default_rng([rank, size, experts])
    expert = rng.choice(experts, n, p=weights / weights.sum()).astype(np.int64)
    base = (1000 * rank + np.arange(n)).reshape((n,) + (1,) * len(shape))
    features = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape) / 8 if shape else 0
    return (base + features).astype(dtype), expert


def _received(case: tuple, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """What rank receives in a dispatch, and its counts, computed in one process from every rank's rows."""
    experts = _experts(case, size)
    local = experts // size
    mine = range(rank * local, (rank + 1) * local)
    rows, counts = [], np.zeros((size, local), dtype=np.int64)
    for s in range(size):
        x, expert = _rows(case, s, size)
        for j, e in enumerate(mine):
            rows.append(x[expert == e])
            counts[s, j] = np.count_nonzero(expert == e)
    return np.concatenate(rows), counts


def _sent_bytes(case: tuple, rank: int, size: int) -> list[int]:
    """Bytes of the rows this rank sends each rank in a dispatch (and receives back from it in combine)."""
    x, expert = _rows(case, rank, size)
    per_rank = np.bincount(expert, minlength=_experts(case, size)).reshape(size, -1).sum(1)
    return [int(c) * x.itemsize * int(np.prod(x.shape[1:], dtype=np.int64)) for c in per_rank]


def _calls_problem(traffic: Traffic, calls: list[str], want_bytes: dict[str, list[int]]) -> str | None:
    """The collectives called, in order, no point-to-point message, and the bytes each sends to every rank."""
    if traffic.calls != calls:
        if sorted(traffic.calls) == sorted(calls):
            return (
                f"called {' then '.join(traffic.calls)}: exchange the counts first (Alltoall), so that every "
                "rank knows how much it receives before the rows travel"
            )
        got = ", ".join(traffic.calls) or "no collective"
        return f"called {got}; expected exactly {' then '.join(calls)}"
    if any(e.tag != COLLECTIVE_TAG for e in traffic.events):
        return "sent or received point-to-point messages: the collectives named carry everything"
    sends = [e.nbytes for e in traffic.sends]
    start = 0
    for name in calls:
        want = want_bytes[name]
        sent = sends[start : start + len(want)]
        if sent != want:
            d = next(d for d, (a, b) in enumerate(zip(sent, want)) if a != b)
            return f"its {name} sends rank {d} {sent[d]} bytes, expected {want[d]} (counts and displacements are in elements)"
        start += len(want)
    return None


def _sizes(world: MPI.Comm) -> list[int]:
    """The world's size first (an answer that calls the notebook's communicator completes there, and is
    seen to), then 1 .. size - 1."""
    size = world.Get_size()
    return [size, *range(1, size)]


def _pair(result: Any, first: str, second: str) -> str | None:
    if not isinstance(result, tuple) or len(result) != 2:
        return f"should return a tuple ({first}, {second}), got {type(result).__name__}"
    return None


def check_dispatch(fn: Callable[..., tuple[np.ndarray, np.ndarray]], timeout: float = 20.0) -> None:
    """fn(comm, x, expert, n_experts) -> (rows, counts): one Alltoall of counts, then one Alltoallv of rows.

    timeout: seconds a rank may wait for a collective the others never call."""
    world = MPI.COMM_WORLD

    def body(comm: MPI.Comm) -> str | None:
        rank, size = comm.Get_rank(), comm.Get_size()
        for case in CASES:
            experts = _experts(case, size)
            x, expert = _rows(case, rank, size)
            original, original_expert = x.copy(), expert.copy()
            label = f"{count(len(x), np.dtype(case[0]).name + ' row')} of shape {case[1]}, {count(experts, 'expert')}"
            result, traffic = run_counted(
                comm, fn, (x, expert, experts), f"dispatch with {label}", timeout, allow=("Alltoall", "Alltoallv")
            )
            want_rows, want_counts = _received(case, rank, size)
            problem = _pair(result, "rows", "counts")
            if problem is None:
                rows, counts = result
                problem = array_problem(counts, want_counts, "counts (rows from each rank for each local expert)")
                problem = problem or array_problem(rows, want_rows, "the rows received")
                if problem is None and np.shares_memory(rows, x):
                    problem = "returned x or a view of it: return a new array"
            if problem is None and not (np.array_equal(x, original) and np.array_equal(expert, original_expert)):
                problem = "changed x or expert: leave the caller's arrays as they are"
            if problem is None:
                want = {"Alltoall": [(experts // size) * 8] * size, "Alltoallv": _sent_bytes(case, rank, size)}
                problem = _calls_problem(traffic[rank], ["Alltoall", "Alltoallv"], want)
            # every rank of comm agrees on this case's verdict before the next case's collectives
            fail_together(comm, problem and f"{label}: {problem}", f"dispatch on {count(size, 'rank')}")
        return None

    each_size(world, body, "dispatch", _sizes(world))
    passed(world, "dispatch: counts by one Alltoall, then exactly the planned rows by one Alltoallv, in order")


def check_combine(fn: Callable[..., np.ndarray], timeout: float = 20.0) -> None:
    """fn(comm, y, counts, expert, n_experts) -> out: one Alltoallv back, then out[i] is row i's result.

    timeout: seconds a rank may wait for a collective the others never call."""
    world = MPI.COMM_WORLD

    def body(comm: MPI.Comm) -> str | None:
        rank, size = comm.Get_rank(), comm.Get_size()
        for case in CASES:
            experts = _experts(case, size)
            local = experts // size
            x, expert = _rows(case, rank, size)
            rows, counts = _received(case, rank, size)
            # the experts' work: expert e adds 10 (e + 1) to a row, so a result in the wrong place shows
            labels = np.concatenate([np.repeat(rank * local + np.arange(local), row) for row in counts])
            y = (rows + 10 * (labels + 1).reshape((-1,) + (1,) * (rows.ndim - 1))).astype(rows.dtype)
            original = y.copy()
            label = f"{count(len(x), np.dtype(case[0]).name + ' row')} of shape {case[1]}, {count(experts, 'expert')}"
            out, traffic = run_counted(
                comm,
                fn,
                (y, counts.copy(), expert.copy(), experts),
                f"combine with {label}",
                timeout,
                allow=("Alltoallv",),
            )
            want = (x + 10 * (expert + 1).reshape((-1,) + (1,) * (x.ndim - 1))).astype(x.dtype)
            problem = array_problem(out, want, "out (row i: the result for this rank's row i)")
            if problem is None and np.shares_memory(out, y):
                problem = "returned y or a view of it: return a new array"
            if problem is None and not np.array_equal(y, original):
                problem = "changed y: leave the caller's array as it is"
            if problem is None:
                row = y.itemsize * int(np.prod(y.shape[1:], dtype=np.int64))
                problem = _calls_problem(
                    traffic[rank], ["Alltoallv"], {"Alltoallv": [int(c) * row for c in counts.sum(1)]}
                )
            # every rank of comm agrees on this case's verdict before the next case's collectives
            fail_together(comm, problem and f"{label}: {problem}", f"combine on {count(size, 'rank')}")
        return None

    each_size(world, body, "combine", _sizes(world))
    passed(world, "combine: one Alltoallv back, every result in its row's place")

"""Checks for lab 11 (communicating less): top-k with error feedback, the sparse allreduce, the hierarchical one.

`check_top_k_with_feedback` feeds the student's residual back step after step on every
rank, checks each step's pairs (int32 indices, the k largest of gradient + residual,
their values) and the new residual, then proves on the ranks what error feedback
promises: the sum over ranks of everything applied plus every residual equals the sum
of all true gradients, after every step.

`check_sparse_allreduce` runs the student's function through a CountingComm that allows
Allgather and Allgatherv, with overlapping indices and a different count on each rank,
compares with MPI's sum of the dense vectors (float64 values that float32 cannot hold),
and holds the bytes each rank sends to its own pairs (4-byte indices plus values) to
every other rank, plus a few for the counts: no more, and no fewer.

Both collective checks run on the whole world first: an answer calling the notebook's
MPI.COMM_WORLD instead of `comm` completes there and sends nothing through `comm`,
which fails it before a smaller communicator would wait forever for the absent ranks.

`check_hierarchical_allreduce` runs it with groups of 1 (3 and 4 groups on 3 and 4 ranks),
2 and 3 consecutive ranks, in float64 and float32, compares with MPI's Allreduce, fails an x changed or a result sharing its memory, and counts the bytes each rank
sends in each step against what the reference sends in it: inside its group before its
last message across groups (the reduce-scatter), to other groups (only its slice may
cross), and inside its group after it (the allgather); then once more on the ranks
numbered differently from the world, where an answer using the world's rank goes wrong.

Under the grader's seed (ddlab.checks._draw) every check draws its cases instead, from the domain
lab 11 states for its exercise (each check's "The grader's draw"), on sub-communicators of drawn
ranks in a drawn order; every failure then names the drawn case and the seed.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..compression import hierarchical_allreduce, node_of
from ..runtime.counting import Traffic
from ._core import array_problem, count, each_size, fail_together, passed, run_counted
from ._draw import Draw, grading_draw, named
from .errors import CheckFailed

#: (n, k, dtype, ties): k = 0 sends nothing; with ties the gradients are small integers, so the k-th
#: largest magnitude is shared and any of the tied items may go.
FEEDBACK_CASES: list[tuple[int, int, Any, bool]] = [
    (60, 6, np.float32, False),
    (33, 1, np.float64, False),
    (8, 8, np.float32, False),
    (20, 0, np.float64, False),
    (30, 5, np.float32, True),
]
FEEDBACK_STEPS = 4
SPARSE_CASES: list[tuple[int, tuple[int, ...], Any]] = [
    (1000, (10, 0, 25, 3), np.float32),
    (40, (10, 40, 7, 10), np.float64),
]
COUNTS_OVERHEAD = 64  # bytes per peer allowed on top of the pairs (the counts' exchange)
#: (group_size, n, dtype); groups of 1: as many groups as ranks. float32 too, as lab 03's checks: a buffer
#: made in NumPy's default float64 fails it.
HIERARCHICAL_CASES: list[tuple[int, int, Any]] = [
    (2, 1001, np.float64),
    (2, 6, np.float64),
    (3, 400, np.float64),
    (1, 300, np.float64),
    (2, 301, np.float32),
]


def _mpi_sum(comm: MPI.Comm, x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    comm.Allreduce(x, out)
    return out


def _call(fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """fn(*args), or the error it raised as a problem (the stub's NotImplementedError passes through)."""
    try:
        return fn(*args), None
    except NotImplementedError:
        raise
    except Exception as err:  # the student's code failed on this rank: report it on all
        return None, f"raised {type(err).__name__}: {err}"


def _pairs_problem(out: Any, fed: np.ndarray, k: int) -> str | None:
    """What is wrong with one step's (indices, values, residual), or None."""
    if not isinstance(out, tuple) or len(out) != 3:
        return f"should return a tuple (indices, values, residual), got {type(out).__name__}"
    indices, values, residual = out
    n = fed.size
    if not isinstance(indices, np.ndarray) or indices.dtype != np.int32 or indices.shape != (k,):
        what = (
            f"{indices.dtype} array of shape {indices.shape}"
            if isinstance(indices, np.ndarray)
            else type(indices).__name__
        )
        return f"indices should be a 1-D int32 array of k = {k} positions, got {what}"
    if indices.size and (indices.min() < 0 or indices.max() >= n or np.unique(indices).size != k):
        return f"indices should be {k} distinct positions in 0..{n - 1}, got {np.sort(indices)[:8].tolist()}..."
    problem = array_problem(values, fed[indices], "values (the items of gradient + residual at indices)")
    if problem:
        return problem + ": are you sending the gradient without the residual?"
    left = np.delete(np.abs(fed), indices)
    if k and left.size and np.abs(fed[indices]).min() < left.max():
        return (
            "indices are not the k largest magnitudes of gradient + residual: an item of magnitude "
            f"{left.max():.4g} was left out while one of {np.abs(fed[indices]).min():.4g} was sent"
        )
    kept = fed.copy()
    kept[indices] = 0
    problem = array_problem(residual, kept, "the new residual")
    return problem + " (it should hold exactly what was not sent)" if problem else None


#: The dtypes a gradient comes in (the lab's: the values keep the gradient's dtype).
FLOATS: tuple[Any, ...] = (np.float32, np.float64)


def _feedback_cases(draw: Draw | None) -> list[tuple[int, int, Any, bool]]:
    """The notebook's FEEDBACK_CASES, or the grader's: n up to 200, k = 0, k = n, tied magnitudes, k anywhere."""
    if draw is None:
        return FEEDBACK_CASES
    n = [draw.integer(2, 200, "n", i) for i in range(5)]
    n[2] = draw.integer(1, 40, "n", 2)
    ks = [draw.integer(1, n[0] - 1, "k", 0), 0, n[2], draw.integer(1, n[3] - 1, "k", 3), draw.integer(0, n[4], "k", 4)]
    dtypes = [FLOATS[draw.integer(0, 1, "dtype", i)] for i in range(5)]
    return [(n[i], ks[i], dtypes[i], i == 3) for i in range(5)]


def check_top_k_with_feedback(
    fn: Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> None:
    """fn(gradient, residual, k) -> (indices, values, residual), step after step on every rank.

    The grader's draw: the ranks (in a drawn order), 5 lengths up to 200 with k drawn (one 0, one n, one with
    tied magnitudes), float32 or float64 each, and the gradients' data seed; FEEDBACK_STEPS steps as the lab says."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "top_k_with_feedback")
    seed = None if draw is None else draw.data_seed("gradients")

    def body(sub: MPI.Comm) -> None:
        for n, k, dtype, ties in _feedback_cases(draw):
            residual = np.zeros(n, dtype)
            truth, applied = np.zeros(n), np.zeros(n)
            for step in range(FEEDBACK_STEPS):
                keys = [n, step, sub.Get_rank()] if seed is None else [n, step, sub.Get_rank(), seed]
                rng = np.random.default_rng(keys)
                gradient = (rng.integers(-2, 3, n) if ties else rng.standard_normal(n)).astype(dtype)
                before, fed = gradient.copy(), gradient + residual
                out, problem = _call(fn, gradient, residual, k)
                context = (
                    f"top_k_with_feedback (n={n}, k={k}{', tied magnitudes' if ties else ''}, "
                    f"{np.dtype(dtype).name}, step {step + 1}"
                    + ("" if seed is None else f", gradients of seed {seed}")
                    + f"){named(draw)}"
                )
                if problem is None and not np.array_equal(gradient, before):
                    problem = "changed the gradient passed in: compute gradient + residual into a new array"
                problem = problem or _pairs_problem(out, fed, k)
                if problem is None and np.shares_memory(out[2], gradient):
                    problem = "the residual returned shares memory with the gradient: return a new array"
                fail_together(sub, problem, context)
                indices, values, residual = out
                sent = np.zeros(n)
                sent[indices] = values
                truth += _mpi_sum(sub, gradient.astype(np.float64))
                applied += _mpi_sum(sub, sent)
                held = _mpi_sum(sub, residual.astype(np.float64))
                gap = np.abs(applied + held - truth).max()
                fail_together(
                    sub,
                    None
                    if gap < 1e-4
                    else f"the sum over ranks of what was sent plus the residuals is {gap:.3g} away from the "
                    "sum of all true gradients",
                    context,
                )
        return None

    each_size(comm, body, "top_k_with_feedback", draw=draw)
    passed(
        comm,
        "top-k with error feedback: the k largest of gradient + residual, and nothing lost over "
        f"{FEEDBACK_STEPS} steps on every rank count{named(draw)}",
    )


def _sparse_input(n: int, k: int, dtype: type, rank: int, seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """k distinct int32 indices and their values: small integers in float32 and the integer dtypes (exact sums in
    any order), random normals in float64, which float32 cannot hold (a float32 buffer on the way shows)."""
    rng = np.random.default_rng([n, k, rank] if seed is None else [n, k, rank, seed])
    indices = rng.choice(n, size=k, replace=False).astype(np.int32)
    if np.dtype(dtype) == np.float64:
        return indices, rng.standard_normal(k)
    return indices, rng.integers(-9, 10, size=k).astype(dtype)


def _world_first(comm: MPI.Comm) -> range:
    """comm's sizes from its own down (see each_size: an answer on MPI.COMM_WORLD fails, not hangs)."""
    return range(comm.Get_size(), 0, -1)


#: What to suspect when nothing went through `comm`.
OTHER_COMMUNICATOR = (
    "are the messages sent on another communicator, such as the notebook's `comm` (MPI.COMM_WORLD), instead "
    "of the `comm` passed in? On fewer ranks than the world's, that would wait forever for ranks that never join"
)


#: The dtypes the grader draws for 11.2 and 11.3 (their contracts: the result in the input's dtype, any dtype): the
#: notebook's two floats and integers of every size, among them the 1 and 2 bytes the notebook never shows.
DRAWN_DTYPES: tuple[Any, ...] = (np.float32, np.float64, np.int64, np.int32, np.int16, np.int8)
NARROW: tuple[Any, ...] = (np.int16, np.int8)


def _sparse_cases(draw: Draw | None) -> list[tuple[int, tuple[int, ...], Any]]:
    """The notebook's SPARSE_CASES, or the grader's three: n up to 1000 in a float dtype, n up to 40 in int16 or int8
    with a rank sending all n pairs, n up to 300 in any of DRAWN_DTYPES; each rank's count drawn, one of them 0."""
    if draw is None:
        return SPARSE_CASES
    ns = [draw.integer(50, 1000, "n", 0), draw.integer(1, 40, "n", 1), draw.integer(1, 300, "n", 2)]
    dtypes = [draw.choose(FLOATS, 1, 0)[0], draw.choose(NARROW, 1, 1)[0], draw.choose(DRAWN_DTYPES, 1, 2)[0]]
    cases = []
    for i, n in enumerate(ns):
        ks = [draw.integer(0, min(n, 60), "k", i, r) for r in range(4)]
        none, every = draw.rng("who", i).permutation(4)[:2]
        ks[none] = 0
        if i == 1:
            ks[every] = n
        cases.append((n, tuple(ks), dtypes[i]))
    return cases


def check_sparse_allreduce(fn: Callable[[Any, np.ndarray, np.ndarray, int], np.ndarray]) -> None:
    """fn(comm, indices, values, n) -> the dense sum over ranks, through Allgather(v) of the pairs only.

    The grader's draw: the ranks (in a drawn order; the whole world first), 3 lengths up to 1000, the pairs
    each rank holds (one none, one all n), the values' dtype (a float, int16 or int8, any), the data seed."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "sparse_allreduce")
    seed = None if draw is None else draw.data_seed("pairs")
    cases = _sparse_cases(draw)

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        found = None  # every rank runs every case (each a collective), then reports its first problem
        for n, ks, dtype in cases:
            k = ks[rank % len(ks)]
            indices, values = _sparse_input(n, k, dtype, rank, seed)
            dense = np.zeros(n, dtype)
            dense[indices] = values
            context = f"sparse_allreduce (n={n}, {np.dtype(dtype).name})"
            if draw is not None:
                context = (
                    f"sparse_allreduce (n={n}, {np.dtype(dtype).name}, {k} pairs here, data seed {seed}){named(draw)}"
                )
            got, traffic = run_counted(
                sub, fn, (indices.copy(), values.copy(), n), context, allow=("Allgather", "Allgatherv")
            )
            problem = array_problem(got, _mpi_sum(sub, dense), "the sum", rtol=1e-12, atol=1e-12)
            if problem is None and np.shares_memory(got, values):
                problem = "the result shares memory with the values passed in: return a new array"
            if problem is None:
                problem = _sparse_bytes_problem(traffic[rank], k, np.dtype(dtype).itemsize, size)
            found = found or (problem and f"{context}: {problem}")
        return found

    each_size(comm, body, "sparse_allreduce", _world_first(comm), draw=draw)
    passed(comm, f"sparse allreduce: the dense sum, each rank sending only its own (index, value) pairs{named(draw)}")


def _sparse_bytes_problem(traffic: Traffic, k: int, value_bytes: int, size: int) -> str | None:
    pairs = k * (4 + value_bytes)
    limit = (size - 1) * (pairs + COUNTS_OVERHEAD)
    if traffic.bytes_sent < (size - 1) * pairs:
        if traffic.bytes_sent == 0:
            return f"sent nothing through `comm`, where its {k} pairs must reach {size - 1} other ranks: {OTHER_COMMUNICATOR}"
        return (
            f"sent {traffic.bytes_sent} bytes, fewer than its {k} pairs take (int32 index + {value_bytes}-byte value, "
            f"{pairs} bytes) to each of the {size - 1} other ranks: are the values sent or received in a narrower "
            "dtype than theirs?"
        )
    if traffic.bytes_sent > limit:
        return (
            f"sent {traffic.bytes_sent} bytes, but its {k} pairs take {pairs} bytes (int32 index + value) to "
            f"each of the {size - 1} other ranks, {limit} with the counts: send only this rank's pairs, "
            "indices as int32"
        )
    return None


def _step_bytes(traffic: Traffic, group_size: int) -> tuple[int, int, int]:
    """Bytes this rank sent inside its group before its last message across groups, across, and inside after it.

    With one group (nothing crosses), all of a rank's messages count as the first step's.
    """
    mine = node_of(traffic.rank, group_size)
    crossing = [i for i, e in enumerate(traffic.events) if node_of(e.peer, group_size) != mine]
    last = crossing[-1] if crossing else len(traffic.events)
    steps = [0, 0, 0]
    for i, e in enumerate(traffic.events):
        if e.kind == "send":
            steps[1 if node_of(e.peer, group_size) != mine else 0 if i < last else 2] += e.nbytes
    return steps[0], steps[1], steps[2]


#: What each step is, for the messages.
HIERARCHICAL_STEPS = (
    "inside its group before the exchange across groups (step 1, the reduce-scatter: each rank sends only "
    "the blocks the others hold)",
    "to ranks of other groups (step 2: only this rank's reduced slice should cross, between the ranks "
    "holding the same slice; do your groups hold consecutive ranks?)",
    "inside its group after the exchange across groups (step 3, the allgather: each rank sends only its own blocks)",
)


def _steps_problem(traffic: list[Traffic], reference: list[Traffic], rank: int, group_size: int) -> str | None:
    """Each step's bytes within the reference's for the same step, on any rank of the group (+5% and the counts)."""
    node = node_of(rank, group_size)
    group = [r for r in range(len(reference)) if node_of(r, group_size) == node]
    sent = _step_bytes(traffic[rank], group_size)
    allowed = [max(_step_bytes(reference[r], group_size)[k] for r in group) for k in range(3)]
    steps = HIERARCHICAL_STEPS
    if node_of(len(reference) - 1, group_size) == 0:  # one group: steps 1 and 3 cannot be told apart
        steps = (
            "inside its group (with one group, steps 1 and 3 together: the reduce-scatter sends only the "
            "blocks the others hold, the allgather only its own)",
            *steps[1:],
        )
    for k, what in enumerate(steps):
        if sent[k] > allowed[k] * 1.05 + COUNTS_OVERHEAD:
            return f"sent {sent[k]} bytes {what}, where the two-level scheme sends at most {allowed[k]}"
    return None


def _crossing_problem(traffic: list[Traffic], rank: int, group_size: int) -> str | None:
    """None unless the sums came right with nothing through comm: from this rank, or across groups at all."""
    if len(traffic) == 1:
        return None
    if traffic[rank].bytes_sent == 0:
        return f"sent nothing through `comm`, yet its x is in every rank's sums: {OTHER_COMMUNICATOR}"
    if node_of(len(traffic) - 1, group_size) > 0 and not any(_step_bytes(t, group_size)[1] for t in traffic):
        return (
            "no rank sent anything to another group through `comm` or a communicator split from it, yet each "
            f"group's sums hold the others' x: {OTHER_COMMUNICATOR}"
        )
    return None


def _hierarchical_cases(draw: Draw | None) -> list[tuple[int, int, Any]]:
    """The notebook's HIERARCHICAL_CASES, or the grader's four: groups of 1, 2, 3 and 4 ranks in a drawn order, one
    length of 1 to 8 (fewer items than blocks) and three up to 1200; float64 or float32 in the first two,
    int16 or int8 in the third, any of DRAWN_DTYPES in the last (lab 03's contract: any dtype)."""
    if draw is None:
        return HIERARCHICAL_CASES
    groups = [int(g) for g in draw.rng("groups").permutation([1, 2, 3, 4])]
    lengths = [draw.integer(1, 8, "n", 0)] + [draw.integer(9, 1200, "n", i) for i in range(1, 4)]
    dtypes = [draw.choose(FLOATS, 1, "dtype", i)[0] for i in range(2)] + [draw.choose(NARROW, 1, "dtype", 2)[0]]
    return list(zip(groups, lengths, [*dtypes, draw.choose(DRAWN_DTYPES, 1, "dtype", 3)[0]]))


def check_hierarchical_allreduce(fn: Callable[[Any, np.ndarray, int], np.ndarray]) -> None:
    """fn(comm, x, group_size) -> the sums, each step sending no more than the two-level scheme's.

    The grader's draw: the ranks (in a drawn order; the whole world first, then renumbered), groups of 1 to 4
    ranks, lengths up to 1200 (one of 1 to 8), float64, float32 and integer dtypes of 1 to 8 bytes, the data seed."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "hierarchical_allreduce")
    seed = None if draw is None else draw.data_seed("x")
    cases = _hierarchical_cases(draw)

    def body(sub: MPI.Comm) -> str | None:
        rank, found = sub.Get_rank(), None
        for group_size, n, dtype in cases:
            keys = [n, rank] if seed is None else [n, rank, seed]
            high = 50 if np.dtype(dtype).itemsize > 1 else 127 // sub.Get_size()  # int8's sums stay in int8
            x = np.random.default_rng(keys).integers(-high, high, n).astype(dtype)
            groups = -(-sub.Get_size() // group_size)
            context = (
                f"hierarchical_allreduce (n={n}, {np.dtype(dtype).name}, groups of {group_size}: "
                f"{count(groups, 'group')}{'' if seed is None else f', data seed {seed}'}){named(draw)}"
            )
            given = x.copy()
            got, traffic = run_counted(sub, fn, (given, group_size), context)
            _, reference = run_counted(sub, hierarchical_allreduce, (x.copy(), group_size), "the reference")
            problem = array_problem(got, _mpi_sum(sub, x), "the sum")
            if not np.array_equal(given, x):
                problem = (
                    "changed x (the sums written into it?): lab 03's contract leaves the caller's x as it was; "
                    "write the sums into a new array"
                )
            if problem is None and np.shares_memory(got, given):
                problem = "the result shares memory with x: return a new array"
            problem = problem or _crossing_problem(traffic, rank, group_size)
            if problem is None:
                problem = _steps_problem(traffic, reference, rank, group_size)
            found = found or (problem and f"{context}: {problem}")
        return found

    each_size(comm, body, "hierarchical_allreduce", _world_first(comm), reordered=True, draw=draw)
    passed(
        comm, f"hierarchical allreduce: MPI's sums, each step sending no more than the two-level scheme{named(draw)}"
    )


# Exercise 11.4: QSGD ----------------------------------------------------------------
QSGD_DRAWS = 400  # draws of the unbiasedness test
QSGD_SIGMAS = 6.0  # how far (in standard errors) the mean of the draws may stray from x


def _qsgd_cases(draw: Draw | None = None) -> list[tuple[str, np.ndarray, int]]:
    """(what, x, s): both dtypes, s from 1 to 127, exact ties, zeros, one item, the lab's size.

    The grader's draw: ties of a drawn Pythagorean pair scaled by a drawn power of two (s a multiple of their
    norm), one drawn item, a zero vector of drawn length, 4 vectors of 2 to 2000 items in either dtype with drawn
    zeros and s, and s as a drawn NumPy integer type."""
    if draw is not None:
        return _drawn_qsgd_cases(draw)
    rng = np.random.default_rng(11)
    cases = [
        ("ties: s |x_i| / ||x|| is an integer", np.array([3.0, -4.0, 0.0, 12.0]), 13),
        ("ties, float32", np.array([-6.0, 8.0], dtype=np.float32), 10),
        ("one item", np.array([-2.5]), 3),
        ("a zero vector", np.zeros(7, dtype=np.float32), 4),
    ]
    for dtype in (np.float32, np.float64):
        for s in (1, 4, 127):
            x = rng.standard_normal(1000).astype(dtype)
            x[::17] = 0
            cases.append((f"{np.dtype(dtype).name}, 1000 items", x, s))
    cases.append(("s given as a NumPy integer", rng.standard_normal(50), np.int64(5)))
    return cases


#: Integer pairs whose norm is whole: (a, b, sqrt(a^2 + b^2)).
PYTHAGOREAN = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29), (9, 40, 41))


def _drawn_qsgd_cases(draw: Draw) -> list[tuple[str, np.ndarray, int]]:
    rng = draw.rng("qsgd cases")
    cases = []
    for i, dtype in enumerate(FLOATS):
        a, b, norm = PYTHAGOREAN[draw.integer(0, len(PYTHAGOREAN) - 1, "triple", i)]
        scale = 2.0 ** draw.integer(-6, 6, "scale", i)
        x = np.zeros(draw.integer(2, 12, "tie length", i))
        where = rng.permutation(x.size)[:2]
        x[where] = np.array([a, b]) * scale * rng.choice([-1, 1], 2)
        s = norm * draw.integer(1, 127 // norm, "multiple", i)
        cases.append((f"ties: s |x_i| / ||x|| is an integer, {np.dtype(dtype).name}", x.astype(dtype), s))
    dtypes = [FLOATS[draw.integer(0, 1, "dtype", i)] for i in range(7)]
    cases.append(("one item", np.array([rng.uniform(-10, 10)], dtype=dtypes[0]), draw.integer(1, 127, "s", 0)))
    cases.append(
        ("a zero vector", np.zeros(draw.integer(1, 50, "zeros"), dtype=dtypes[1]), draw.integer(1, 127, "s", 1))
    )
    for i in range(2, 6):
        n = draw.integer(2, 2000, "length", i)
        x = (rng.standard_normal(n) * 10.0 ** draw.integer(-3, 3, "magnitude", i)).astype(dtypes[i])
        x[rng.random(n) < 0.1] = 0
        cases.append((f"{np.dtype(dtypes[i]).name}, {n} items", x, draw.integer(1, 127, "s", i)))
    kind = draw.choose((np.int8, np.int16, np.int32, np.int64), 1, "s type")[0]
    s = kind(draw.integer(1, 127, "s", 6))
    n = draw.integer(2, 200, "length", 6)
    cases.append((f"s given as a NumPy {np.dtype(kind).name}", rng.standard_normal(n).astype(dtypes[6]), s))
    return cases


def _bad_levels(draw: Draw | None) -> tuple[Any, ...]:
    """s the lab says to refuse: the notebook's 0, 128 and 2.5; or drawn: below 1, above 127, not whole, a whole float."""
    if draw is None:
        return (0, 128, 2.5)
    return (
        draw.integer(-200, 0, "bad low"),
        draw.integer(128, 10**4, "bad high"),
        draw.integer(1, 126, "bad fraction") + draw.integer(1, 9, "tenths") / 10,
        float(draw.integer(1, 127, "bad float")),
    )


def _levels_problem(out: Any, x: np.ndarray, s: int) -> str | None:
    """What is wrong with one (norm, levels), or None; they may differ from the reference's draw by draw."""
    if not isinstance(out, tuple) or len(out) != 2:
        return f"should return a tuple (norm, levels), got {type(out).__name__}"
    norm, levels = out
    want = np.array([np.linalg.norm(x.astype(np.float64))]).astype(x.dtype)
    if not isinstance(norm, np.ndarray) or norm.shape != (1,) or norm.dtype != x.dtype:
        return f"norm should be an array of shape (1,) in x's dtype {x.dtype}, got {norm!r}"
    if not np.isclose(norm[0], want[0], rtol=1e-5, atol=0):
        return f"norm is {norm[0]:.6g}, expected ||x||_2 = {want[0]:.6g} (QSGD scales by the 2-norm)"
    if not isinstance(levels, np.ndarray) or levels.dtype != np.int8 or levels.shape != x.shape:
        what = f"{levels.dtype} {levels.shape}" if isinstance(levels, np.ndarray) else type(levels).__name__
        return f"levels should be an int8 array of shape {x.shape} (one byte per item), got {what}"
    if want[0] == 0:
        return None if not levels.any() else "a zero vector must give zero levels"
    ratio = np.abs(x.astype(np.float64)) / float(want[0]) * int(s)
    # an integer, up to float32's rounding (1e-4 s, as before, called 1.997 an integer at s = 33: a right answer's
    # level 1 there, drawn with probability 0.003, failed; the ties the check builds are exact)
    tie = np.abs(ratio - np.round(ratio)) <= 1e-6 * np.maximum(ratio, 1.0)
    low = np.where(tie, np.round(ratio), np.floor(ratio))
    high = np.where(tie, low, low + 1)
    size = np.abs(levels.astype(np.int64))
    bad = np.flatnonzero((size < low) | (size > high) | (np.sign(levels) * np.sign(x) < 0))
    if bad.size:
        i = bad[0]
        return (
            f"levels[{i}] is {levels[i]} for x[{i}] = {x[i]:.6g}: s |x_i| / ||x|| = {ratio[i]:.4f}, so the "
            f"level is {'-' if x[i] < 0 else ''}{int(low[i])}"
            + ("" if tie[i] else " or one more in size")
            + ", with x_i's sign"
        )
    return None


def check_qsgd(
    qsgd: Callable[[np.ndarray, int, np.random.Generator], tuple[np.ndarray, np.ndarray]],
    unqsgd: Callable[[np.ndarray, np.ndarray, int], np.ndarray],
) -> None:
    """qsgd(x, s, rng) -> (norm, levels) and unqsgd(norm, levels, s) -> estimate: QSGD, unbiased, seeded by rng.

    The grader's draw: the vectors, s, its type and the rng's seeds (see _qsgd_cases), the unbiasedness test's
    vector and two s up to 8, and the s to refuse (see _bad_levels); both dtypes every time."""
    draw = grading_draw(None, "qsgd")  # runs in the kernel or on each engine alike: no communicator
    seed = 3 if draw is None else draw.data_seed("rng")
    for what, x, s in _qsgd_cases(draw):
        case = f"qsgd on {what} (s = {s}{'' if draw is None else f', rng seed {seed}'}){named(draw)}"
        original = x.copy()
        out = qsgd(x, s, np.random.default_rng(seed))
        problem = "changed x: leave the caller's gradient as it is" if not np.array_equal(x, original) else None
        problem = problem or _levels_problem(out, x, s)
        if problem is None and x.any():
            again = qsgd(x, s, np.random.default_rng(seed))
            if not isinstance(again, tuple) or not np.array_equal(again[1], out[1]):
                problem = "the same seeded rng gave other levels: draw every random number from `rng`"
        if problem is None:
            decoded = unqsgd(out[0].copy(), out[1].copy(), s)
            want = out[1].astype(x.dtype) * (out[0][0] / x.dtype.type(s))
            problem = array_problem(decoded, want, "unqsgd(norm, levels, s)")
        if problem:
            raise CheckFailed(f"{case}: {problem}")
    _check_unbiased(qsgd, unqsgd, draw)
    for bad in _bad_levels(draw):
        try:
            qsgd(np.ones(3), bad, np.random.default_rng(0))
        except ValueError:
            continue
        raise CheckFailed(
            f"qsgd(x, s={bad!r}, rng) returned; s must be an int from 1 to 127: raise ValueError{named(draw)}"
        )
    print(
        f"passed: qsgd keeps the 2-norm and rounds each |x_i| to a neighbouring level at random; unbiased{named(draw)}"
    )


def _check_unbiased(
    qsgd: Callable[[np.ndarray, int, np.random.Generator], tuple[np.ndarray, np.ndarray]],
    unqsgd: Callable[[np.ndarray, np.ndarray, int], np.ndarray],
    draw: Draw | None = None,
) -> None:
    """The mean of many decoded draws must approach x: each item's error has variance <= (||x|| / 2s)^2."""
    if draw is None:
        x, rng, levels = np.random.default_rng(5).standard_normal(64), np.random.default_rng(6), [1, 3]
    else:
        x = np.random.default_rng(draw.data_seed("unbiased x")).standard_normal(draw.integer(16, 96, "unbiased n"))
        rng, levels = np.random.default_rng(draw.data_seed("unbiased rng")), draw.lengths(2, 1, 8, "unbiased s")
    for s in levels:
        mean = np.mean([unqsgd(*qsgd(x, s, rng), s) for _ in range(QSGD_DRAWS)], axis=0)
        stderr = np.linalg.norm(x) / (2 * s * np.sqrt(QSGD_DRAWS))
        worst = int(np.argmax(np.abs(mean - x)))
        if abs(mean[worst] - x[worst]) > QSGD_SIGMAS * stderr:
            raise CheckFailed(
                f"qsgd is biased (s = {s}{'' if draw is None else f', x of {x.size} items'}{named(draw)}): over "
                f"{QSGD_DRAWS} draws item {worst} averages {mean[worst]:.4f}, "
                f"x holds {x[worst]:.4f} (at most {QSGD_SIGMAS * stderr:.4f} away if unbiased): round up with "
                "probability equal to the fraction s |x_i| / ||x|| - floor(s |x_i| / ||x||)"
            )

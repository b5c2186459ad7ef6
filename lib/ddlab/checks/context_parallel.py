"""Checks of lab 15's first part (context parallelism): the merge, the ring, the zig-zag split.

- `check_merge_partials(fn)`: fn(o1, m1, l1, o2, m2, l2) -> (o, m, l), the partial attention
  result over the keys of both (module docstring of `ddlab.context_parallel.blockwise`): new
  arrays, inputs left alone, rows that saw no key in either (m = -inf) staying (0, -inf, 0).
- `check_ring_attention(fn)`: fn(comm, q, k, v, positions) -> (out, lse), this rank's rows of
  causal attention over every rank's keys, and their log-sum-exp; messages only to the next rank,
  exactly P-1 blocks of K and V each (no collectives); a ring that deadlocks fails at the deadline.
- `check_zigzag(split, unsplit)`: split(x, size, rank) -> rank's rows (chunk rank, then chunk
  2*size-1-rank, of x padded with zero rows to a multiple of 2*size); unsplit(parts, length) -> x.

Every value is compared with one process in float64 (1e-10); the multi-rank ones on 1, 2, 3 and
4 ranks, at lengths 2P divides and lengths it does not.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..context_parallel import (
    Partial,
    all_positions,
    attend_block,
    merge_partials,
    reference_attention,
    ring_attention,
    take_rows,
)
from ..runtime.counting import Traffic
from ._core import array_problem, each_size, fail_together, passed, run_counted
from .errors import CheckFailed

#: Tolerance of every comparison with one process (float64).
TOLERANCE = 1e-10
#: Seconds a ring may wait for a block before the check calls it a deadlock.
DEADLINE = 10.0


def _close_problem(got: Any, want: np.ndarray, what: str) -> str | None:
    """None if got is an array of want's shape and dtype within TOLERANCE (infinities where want has them)."""
    return array_problem(got, want, what, rtol=TOLERANCE, atol=TOLERANCE)


def _call(fn: Callable[..., Any], *args: Any, what: str) -> tuple[Any, str | None]:
    """(fn(*args), None), or (None, what went wrong) if it raised (a stub's NotImplementedError passes through)."""
    try:
        return fn(*args), None
    except NotImplementedError:
        raise
    except Exception as err:  # the student's function failed: say so, do not crash the check
        return None, f"{what} raised {type(err).__name__}: {err}"


def _merge_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v of 8 positions in 2 heads; the later keys score higher, so their block's maximum is larger."""
    rng = np.random.default_rng(15)
    q, k, v = (rng.standard_normal((2, 8, 3)) for _ in range(3))
    k[..., 4:, :] *= 4.0
    return q, k, v


def _merge_cases() -> list[tuple[str, Partial, Partial]]:
    """(description, first partial, second partial) made by attend_block from real scores."""
    q, k, v = _merge_inputs()
    pos = np.arange(8)
    empty = attend_block(q, k, v, pos, pos + 100)  # every key in the future: no row sees any
    early, late = (
        attend_block(q, k[..., :4, :], v[..., :4, :], pos, pos[:4]),
        attend_block(q, k[..., 4:, :], v[..., 4:, :], pos, pos[4:]),
    )
    return [
        ("first block then a later one (the later maximum larger on most rows; rows 0-3 see none of it)", early, late),
        ("a later block then an earlier one", late, early),
        ("a block merged into nothing yet (m = -inf, l = 0; rows 0-3 see nothing in either)", empty, late),
    ]


def check_merge_partials(fn: Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """fn(o1, m1, l1, o2, m2, l2) -> (o, m, l): the partial over both blocks' keys, in new arrays."""
    comm = MPI.COMM_WORLD
    problem = None
    for description, first, second in _merge_cases():
        given = tuple(a.copy() for a in (*first, *second))
        got, problem = _call(fn, *given, what="merge")
        want = merge_partials(first, second)
        if problem:
            problem = f"{description}: {problem}"
        elif not isinstance(got, tuple) or len(got) != 3:
            problem = f"{description}: return a tuple (o, m, l), got {type(got).__name__}"
        else:
            for name, g, w in zip(("o", "m", "l"), got, want):
                problem = problem or _close_problem(g, w, f"{description}: {name}")
            if problem is None and any(not np.array_equal(a, b) for a, b in zip(given, (*first, *second))):
                problem = f"{description}: an input was changed: return new arrays, leave the partials alone"
            if problem is None and any(np.shares_memory(g, a) for g in got for a in given):
                problem = f"{description}: a result shares memory with an input: return new arrays"
        if problem:
            break
    if problem is None:  # the merged partial, finished, is softmax attention over both blocks
        _, first, second = _merge_cases()[0]
        merged, _, total = fn(*(a.copy() for a in (*first, *second)))
        if not np.allclose(merged / total[..., None], reference_attention(*_merge_inputs())[0], rtol=0, atol=TOLERANCE):
            problem = "the merged result, divided by l, is not the causal attention over both blocks"
    if problem:
        raise CheckFailed(
            f"merge_partials: {problem}\n(rescale each partial's o and l by exp(its m - the new m), the new m "
            "being the larger; a row where both m are -inf has seen nothing: keep it 0, -inf, 0)"
        )
    passed(comm, "merge_partials: two partial attention results merge exactly, empty rows included")


def _ring_problem(traffic: list[Traffic], rank: int, size: int, block_bytes: int) -> str | None:
    mine = traffic[rank]
    if size > 1 and {e.peer for e in mine.sends} != {(rank + 1) % size}:
        return (
            f"rank {rank} sent to ranks {sorted({e.peer for e in mine.sends})}: in a ring each rank sends only "
            f"to the next, rank {(rank + 1) % size}"
        )
    want = (size - 1) * block_bytes
    if mine.bytes_sent != want:
        return (
            f"rank {rank} sent {mine.bytes_sent} bytes, the ring sends {want}: {size - 1} steps, each passing on "
            "the K and V block held (positions are known to every rank: do not send them)"
        )
    return None


def _real_rows(got: Any, want: np.ndarray, real: np.ndarray, vectors: bool) -> Any:
    """got with its padding rows (where `real` is False) set to want's: their outputs are dropped, any will do.

    vectors: got is (..., n, d) (the output), else (..., n) (the log-sum-exp)."""
    if not isinstance(got, np.ndarray) or got.shape != want.shape or got.dtype != want.dtype:
        return got
    rows = got.copy()
    if vectors:  # out (..., n, d): rows on axis -2
        rows[..., ~real, :] = want[..., ~real, :]
    else:  # lse (..., n)
        rows[..., ~real] = want[..., ~real]
    return rows


def check_ring_attention(fn: Callable[..., tuple[np.ndarray, np.ndarray]], timeout: float = DEADLINE) -> None:
    """fn(comm, q, k, v, positions) -> (out, lse) of this rank's rows, over every rank's keys."""
    comm = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        for shape, zigzag in (((4 * size, 3), True), ((2, 2, 4 * size + 3, 4), True), ((4 * size + 1, 2), False)):
            length = shape[-2]
            layout = "zig-zag" if zigzag else "contiguous"
            context = f"ring attention, {length} positions of shape {shape}, {layout} layout"
            rng = np.random.default_rng([*shape, 15])
            q, k, v = (rng.standard_normal(shape) for _ in range(3))
            positions = all_positions(length, size, zigzag)
            mine = q_mine, k_mine, v_mine = [take_rows(a, positions[rank]) for a in (q, k, v)]
            given = [a.copy() for a in mine]
            got, traffic = run_counted(sub, fn, (*given, positions.copy()), context, timeout=timeout)
            want = ring_attention(sub, q_mine, k_mine, v_mine, positions)
            real = positions[rank] < length
            problem = None
            if not isinstance(got, tuple) or len(got) != 2:
                problem = f"return a tuple (out, lse), got {type(got).__name__}"
            else:
                for name, g, w in zip(("out", "lse"), got, want):
                    problem = problem or _close_problem(
                        _real_rows(g, w, real, name == "out"), w, f"rank {rank}'s {name}"
                    )
            if problem is None and any(not np.array_equal(a, b) for a, b in zip(given, mine)):
                problem = "q, k or v was changed: send copies, or receive into new buffers"
            found = problem or _ring_problem(traffic, rank, size, mine[1].nbytes + mine[2].nbytes)
            fail_together(sub, found and f"{context}: {found}", "ring attention")
        return None

    each_size(comm, body, "ring attention")
    passed(comm, "ring attention: every rank's rows equal one process's, in P-1 steps of K and V round the ring")


ZIGZAG_HINT = (
    "(pad x with zero rows to a multiple of 2*size, cut it into 2*size chunks of equal length; rank r holds "
    "chunk r, then chunk 2*size-1-r; unsplit puts them back and drops the padding)"
)


def _zigzag_problem(
    split: Callable[[np.ndarray, int, int], np.ndarray],
    unsplit: Callable[[list[np.ndarray], int], np.ndarray],
    size: int,
    shape: tuple[int, ...],
) -> str | None:
    """What is wrong with split and unsplit for one sequence on `size` ranks, on one process."""
    length = shape[-2]
    context = f"{length} positions of shape {shape} on {size} ranks"
    x = np.random.default_rng([*shape, size]).standard_normal(shape)
    positions = all_positions(length, size)
    parts = []
    for rank in range(size):
        got, problem = _call(split, x.copy(), size, rank, what=f"split(x, {size}, {rank})")
        problem = problem or _close_problem(got, take_rows(x, positions[rank]), f"rank {rank}'s split")
        if problem is None and np.shares_memory(got, x):
            problem = f"rank {rank}'s split shares memory with x: return a new array"
        if problem:
            return f"{context}: {problem}"
        parts.append(got)
    given = [p.copy() for p in parts]
    back, problem = _call(unsplit, given, length, what="unsplit")
    problem = problem or _close_problem(back, x, "unsplit")
    if problem is None and any(np.shares_memory(back, p) for p in given):
        problem = "unsplit shares memory with a part: return a new array"
    return problem and f"{context}: {problem}"


def check_zigzag(
    split: Callable[[np.ndarray, int, int], np.ndarray], unsplit: Callable[[list[np.ndarray], int], np.ndarray]
) -> None:
    """split(x, size, rank) -> rank's rows; unsplit(parts, length) -> x: one process, then ring attention on P ranks."""
    comm = MPI.COMM_WORLD
    problem = None
    for size in (1, 2, 3, 4):
        for shape in ((8 * size, 2), (8 * size + 3, 2), (1, 3), (2, 2 * size - 1, 2)):
            problem = _zigzag_problem(split, unsplit, size, shape)
            if problem:
                raise CheckFailed(f"zig-zag: {problem}\n{ZIGZAG_HINT}")

    def body(sub: MPI.Comm) -> str | None:  # the split and unsplit around ring attention on P ranks
        rank, size = sub.Get_rank(), sub.Get_size()
        length = 6 * size + 1
        q, k, v = (np.random.default_rng([length, i]).standard_normal((2, length, 3)) for i in range(3))
        positions = all_positions(length, size)
        mine, problem = [], None
        for a in (q, k, v):
            got, problem = _call(split, a.copy(), size, rank, what=f"split(x, {size}, {rank})")
            problem = problem or _close_problem(got, take_rows(a, positions[rank]), f"rank {rank}'s split")
            if problem:
                break
            mine.append(got)
        fail_together(sub, problem, f"zig-zag split of {length} positions")  # before the ring, which needs all ranks
        out, _ = ring_attention(sub, mine[0], mine[1], mine[2], positions)
        back, problem = _call(unsplit, sub.allgather(out), length, what="unsplit")
        return problem or _close_problem(back, reference_attention(q, k, v)[0], "unsplit of the ranks' outputs")

    each_size(comm, body, "zig-zag split around ring attention")
    passed(comm, "zig-zag: each rank holds chunks r and 2P-1-r, padded; unsplit restores the sequence")

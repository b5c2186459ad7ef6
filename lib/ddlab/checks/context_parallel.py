"""Checks of lab 15's first part (context parallelism): the merge, the ring, the zig-zag split.

- `check_merge_partials(fn)`: fn(o1, m1, l1, o2, m2, l2) -> (o, m, l), the partial attention
  result over the keys of both (module docstring of `ddlab.context_parallel.blockwise`): new
  arrays, inputs left alone, rows that saw no key in either (m = -inf) staying (0, -inf, 0).
- `check_ring_attention(fn)`: fn(comm, q, k, v, positions) -> (out, lse), this rank's rows of
  causal attention over every rank's keys, and their log-sum-exp; messages only to the next rank,
  exactly P-1 blocks of K and V each (no collectives); a ring that deadlocks fails at the deadline.
- `check_ring_attention_backward(fn)`: fn(comm, q, k, v, out, lse, grad_out, positions, causal) -> (dq, dk, dv)
  of this rank's rows, equal to autograd on one process, causal and not (causal=False: every query sees
  every key, at lengths 2P divides); messages only to the next rank, exactly P-1 blocks of K and V and
  P blocks of their gradients each, Isend/Irecv or Sendrecv alike.
- `check_ulysses(fn)`: fn(comm, q, k, v, positions) -> this rank's output (H, n, d), equal to one
  process; exactly three Alltoalls of q, k, v there and one of the output back, nothing else.
- `check_zigzag(split, unsplit)`: split(x, size, rank) -> rank's rows (chunk rank, then chunk
  2*size-1-rank, of x padded with zero rows to a multiple of 2*size); unsplit(parts, length) -> x.

Every value is compared with one process, in float64 (1e-10) and float32 (1e-5 relative, against
float64 from the same inputs); the multi-rank ones on the whole world first (an answer on the
notebook's communicator fails there, with a message), then 1 .. P-1 ranks, at lengths 2P divides and
lengths it does not, and every rank agrees on a case's verdict before the next case.

Under the grader's seed (ddlab.checks._draw) each check draws its cases instead of the notebook's: the
ranks of every sub-communicator (any P of the world's, in any order), the lengths (2P dividing them and
not, down to fewer rows than ranks), leading axes, head widths, head counts (multiples of P), dtypes
(float64 and float32, as the lab states), layouts and the inputs' data; every failure names the case
and the seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
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
from ..runtime.counting import COLLECTIVE_TAG, Traffic
from ._core import array_problem, deadline, each_size, fail_together, fail_together_once, passed, run_counted
from ._draw import Draw, grading_draw, named
from .errors import CheckFailed

#: Tolerance of every comparison with one process (float64).
TOLERANCE = 1e-10
#: Seconds a ring may wait for a block before the check calls it a deadlock.
DEADLINE = 10.0


#: Relative tolerance of a float32 answer against float64 computed from the same inputs.
TOLERANCE32 = 1e-5
#: The dtypes the lab's attention exercises state (15.2-15.5): the grader draws from these.
DTYPES = ("float64", "float32")


def _close_problem(got: Any, want: np.ndarray, what: str) -> str | None:
    """None if got is an array of want's shape and dtype within TOLERANCE (TOLERANCE32 in float32)."""
    tol = TOLERANCE32 if want.dtype == np.float32 else TOLERANCE
    return array_problem(got, want, what, rtol=tol, atol=tol)


def _world_first(comm: MPI.Comm) -> list[int]:
    """The world's size first (an answer on the notebook's communicator completes there and is seen to), then 1 .. P-1."""
    return [comm.Get_size(), *range(1, comm.Get_size())]


def _call(fn: Callable[..., Any], *args: Any, what: str) -> tuple[Any, str | None]:
    """(fn(*args), None), or (None, what went wrong) if it raised (a stub's NotImplementedError passes through)."""
    try:
        return fn(*args), None
    except NotImplementedError:
        raise
    except Exception as err:  # the student's function failed: say so, do not crash the check
        return None, f"{what} raised {type(err).__name__}: {err}"


#: Seconds one call of a one-process answer (merge, split, unsplit) may take: a correct one takes milliseconds.
CALL_DEADLINE = 10.0


def _timed_call(fn: Callable[..., Any], *args: Any, what: str) -> tuple[Any, str | None]:
    """_call within CALL_DEADLINE: a call that never returns becomes this rank's problem, not a hang."""
    try:
        with deadline(CALL_DEADLINE, what):
            return _call(fn, *args, what=what)
    except CheckFailed as err:
        return None, str(err)


@dataclass(frozen=True)
class MergeCase:
    """The inputs of check_merge_partials: q, k, v of `shape` (..., n, d) from `seed`, the keys from row `split`
    on scaled by `scale` (so their block's maximum is larger); the notebook's by default."""

    shape: tuple[int, ...] = (2, 8, 3)
    split: int = 4
    scale: float = 4.0
    seed: int = 15

    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        q, k, v = (rng.standard_normal(self.shape) for _ in range(3))
        k[..., self.split :, :] *= self.scale
        return q, k, v


def _merge_case(draw: Draw | None) -> MergeCase:
    """The notebook's case, or the grader's: up to 2 leading axes, 2 to 16 rows cut anywhere, widths 1 to 6."""
    if draw is None:
        return MergeCase()
    lead = tuple(draw.integer(1, 3, "lead", i) for i in range(draw.integer(0, 2, "axes")))
    rows = draw.integer(2, 16, "rows")
    shape = (*lead, rows, draw.integer(1, 6, "width"))
    return MergeCase(shape, draw.integer(1, rows - 1, "split"), draw.integer(2, 8, "scale"), draw.data_seed("merge"))


def _merge_cases(case: MergeCase) -> list[tuple[str, Partial, Partial]]:
    """(description, first partial, second partial) made by attend_block from real scores."""
    q, k, v = case.inputs()
    rows, split = case.shape[-2], case.split
    pos = np.arange(rows)
    empty = attend_block(q, k, v, pos, pos + 100)  # every key in the future: no row sees any
    early, late = (
        attend_block(q, k[..., :split, :], v[..., :split, :], pos, pos[:split]),
        attend_block(q, k[..., split:, :], v[..., split:, :], pos, pos[split:]),
    )
    unseen = f"rows 0-{split - 1}" if split > 1 else "row 0"
    return [
        (f"first block then a later one (the later maximum larger on most rows; {unseen} see none of it)", early, late),
        ("a later block then an earlier one", late, early),
        (f"a block merged into nothing yet (m = -inf, l = 0; {unseen} see nothing in either)", empty, late),
    ]


def check_merge_partials(fn: Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """fn(o1, m1, l1, o2, m2, l2) -> (o, m, l): the partial over both blocks' keys, in new arrays.

    The grader's draw: the shape (up to 2 leading axes of up to 3, 2 to 16 rows, widths 1 to 6), where the
    keys are cut into two blocks, how much larger the later block's scores are, and the data's seed; float64,
    as the lab states."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "merge_partials")
    case = _merge_case(draw)
    where = "" if draw is None else f"q, k, v of shape {case.shape} cut at row {case.split}, data seed {case.seed}"
    problem = None
    for description, first, second in _merge_cases(case):
        given = tuple(a.copy() for a in (*first, *second))
        got, problem = _timed_call(fn, *given, what="merge")
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
        _, first, second = _merge_cases(case)[0]
        got, problem = _timed_call(fn, *(a.copy() for a in (*first, *second)), what="merge")
        attention = reference_attention(*case.inputs())[0]
        if problem is None and not np.allclose(got[0] / got[2][..., None], attention, rtol=0, atol=TOLERANCE):
            problem = "the merged result, divided by l, is not the causal attention over both blocks"
    if problem and draw is not None:
        problem = f"{where}, {problem}{named(draw)}"
    fail_together_once(  # every rank ran the same cases: one verdict, said once unless the ranks differ
        comm,
        problem,
        "merge_partials",
        "(rescale each partial's o and l by exp(its m - the new m), the new m being the larger; a row where both "
        "m are -inf has seen nothing: keep it 0, -inf, 0)",
    )
    passed(comm, f"merge_partials: two partial attention results merge exactly, empty rows included{named(draw)}")


def _neighbour_problem(mine: Traffic, rank: int, size: int) -> str | None:
    """What is wrong with whom a ring rank talked to: nobody (the notebook's comm used) or not only the next."""
    if size > 1 and not mine.events:
        return (
            f"rank {rank} sent and received nothing through the communicator it was given: use that `comm`, "
            "not the notebook's"
        )
    if size > 1 and {e.peer for e in mine.sends} != {(rank + 1) % size}:
        return (
            f"rank {rank} sent to ranks {sorted({e.peer for e in mine.sends})}: in a ring each rank sends only "
            f"to the next, rank {(rank + 1) % size}"
        )
    return None


def _ring_problem(traffic: list[Traffic], rank: int, size: int, block_bytes: int) -> str | None:
    mine = traffic[rank]
    neighbours = _neighbour_problem(mine, rank, size)
    if neighbours:
        return neighbours
    want = (size - 1) * block_bytes
    if mine.bytes_sent != want:
        return (
            f"rank {rank} sent {mine.bytes_sent} bytes, the ring sends {want}: {size - 1} steps, each passing on "
            "the K and V block held (positions are known to every rank: do not send them)"
        )
    return None


def CASES(size: int, draw: Draw | None = None) -> list[tuple[tuple[int, ...], bool, str]]:
    """(shape, zig-zag layout?, dtype) of the ring checks' inputs on `size` ranks: 2P divides the length or not,
    leading axes or none, float64 and float32.

    The grader's draw: four cases, lengths a multiple of 2P (up to 12P), one that is not, one shorter than 2P
    and one anywhere up to 12P; up to 2 leading axes of up to 3, widths 1 to 6; both layouts and both dtypes."""
    if draw is None:
        return [
            ((4 * size, 3), True, "float64"),
            ((2, 2, 4 * size + 3, 4), True, "float64"),
            ((4 * size + 1, 2), False, "float64"),
            ((2, 4 * size + 1, 3), True, "float32"),
        ]
    lengths = [
        2 * size * draw.integer(1, 6, "divides", size),
        2 * size * draw.integer(0, 5, "chunks", size) + draw.integer(1, 2 * size - 1, "remainder", size),
        draw.integer(1, 2 * size - 1, "short", size),
        draw.integer(1, 12 * size, "any", size),
    ]
    return [_drawn_case(draw, size, index, length) for index, length in enumerate(lengths)]


def _drawn_case(draw: Draw, size: int, index: int, length: int) -> tuple[tuple[int, ...], bool, str]:
    """(shape, zig-zag?, dtype) of the grader's case `index` of `length` rows: the first two cases take both
    layouts and both dtypes (in a drawn order), the others draw theirs."""
    keys = (size, index)
    lead = tuple(draw.integer(1, 3, "lead", *keys, axis) for axis in range(draw.integer(0, 2, "axes", *keys)))
    shape = (*lead, length, draw.integer(1, 6, "width", *keys))
    if index < 2:  # one of each, in a drawn order
        zigzag = (index + draw.integer(0, 1, "layout", size)) % 2 == 0
        dtype = DTYPES[(index + draw.integer(0, 1, "dtype", size)) % 2]
    else:
        zigzag, dtype = draw.integer(0, 1, "layout", *keys) == 1, draw.choose(DTYPES, 1, *keys)[0]
    return shape, zigzag, dtype


def _data(shape: tuple[int, ...], salt: int, seed: int | None) -> np.random.Generator:
    """The generator of a case's inputs: the notebook's (from the shape), or the grader's data seed."""
    return np.random.default_rng([*shape, salt] if seed is None else seed)


def _seeded(draw: Draw | None, seed: int | None) -> str:
    """', data seed S (the grader's draw, seed G)' to append to a drawn case's description, or ''."""
    return "" if draw is None else f", data seed {seed}{named(draw)}"


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
    """fn(comm, q, k, v, positions) -> (out, lse) of this rank's rows, over every rank's keys.

    The grader's draw: the ranks of every sub-communicator (any P of the world's, in any order), the cases
    of CASES (lengths, leading axes, widths, layouts, float64 and float32) and the inputs' data seeds."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "ring_attention")

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        for index, (shape, zigzag, dtype) in enumerate(CASES(size, draw)):
            length = shape[-2]
            layout = "zig-zag" if zigzag else "contiguous"
            seed = None if draw is None else draw.data_seed("ring", size, index)
            context = f"ring attention, {length} positions of shape {shape} in {dtype}, {layout} layout"
            context += _seeded(draw, seed)
            rng = _data(shape, 15, seed)
            q, k, v = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
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

    each_size(comm, body, "ring attention", _world_first(comm), draw=draw)
    passed(
        comm,
        f"ring attention: every rank's rows equal one process's, in P-1 steps of K and V round the ring{named(draw)}",
    )


def _padded_whole(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x with zero rows appended up to every position in `positions` (the padded sequence)."""
    return take_rows(x, np.arange(positions.size))


def BACKWARD_CASES(size: int, draw: Draw | None = None) -> list[tuple[tuple[int, ...], bool, str, bool]]:
    """(shape, zig-zag layout?, dtype, causal?) of the backward check's inputs on `size` ranks: the forward's
    causal cases, then non-causal ones at lengths 2P divides (no padding key for a query to see).

    The grader's draw: the forward's drawn cases, causal, and two not causal at drawn multiples of 2P."""
    if draw is None:
        free = [((2, 4 * size, 3), True, "float64"), ((4 * size, 2), False, "float32")]
    else:
        lengths = (2 * size * draw.integer(1, 6, "not causal", size, i) for i in range(2))
        free = [_drawn_case(draw, size, index, length) for index, length in enumerate(lengths, start=4)]
    return [
        *((shape, zigzag, dtype, True) for shape, zigzag, dtype in CASES(size, draw)),
        *((shape, zigzag, dtype, False) for shape, zigzag, dtype in free),
    ]


def _one_process_backward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, grad: np.ndarray, positions: np.ndarray, causal: bool = True
) -> tuple[np.ndarray, ...]:
    """(out, lse, dq, dk, dv) of the padded sequence by torch's autograd on one process, in float64.

    The padding rows' output gradient is 0 (they are not part of any loss); their out and lse are
    what every layout's forward gives them (they see the real keys and themselves). Without the
    causal mask every query sees every key (the non-causal cases have no padding)."""
    padded = [torch.from_numpy(_padded_whole(a, positions).astype(np.float64)) for a in (q, k, v)]
    leaves = [t.requires_grad_() for t in padded]
    length = leaves[0].shape[-2]
    scores = leaves[0] @ leaves[1].transpose(-1, -2) / np.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ leaves[2]
    out.backward(torch.from_numpy(_padded_whole(grad, positions).astype(np.float64)))
    grads = [t.grad.numpy() for t in leaves if t.grad is not None]
    return out.detach().numpy(), lse.detach().numpy(), *grads


def check_ring_attention_backward(fn: Callable[..., tuple[np.ndarray, ...]], timeout: float = DEADLINE) -> None:
    """fn(comm, q, k, v, out, lse, grad_out, positions, causal) -> (dq, dk, dv) of this rank's rows, as autograd gives.

    The grader's draw: the ranks of every sub-communicator (any P of the world's, in any order), the cases
    of BACKWARD_CASES (lengths, leading axes, widths, layouts, float64 and float32, causal and not) and the
    inputs' data seeds."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "ring_attention_backward")

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        for index, (shape, zigzag, dtype, causal) in enumerate(BACKWARD_CASES(size, draw)):
            length = shape[-2]
            layout = "zig-zag" if zigzag else "contiguous"
            seed = None if draw is None else draw.data_seed("backward", size, index)
            context = (
                f"ring attention backward, {'causal' if causal else 'not causal'}, {length} positions of shape "
                f"{shape} in {dtype}, {layout} layout{_seeded(draw, seed)}"
            )
            rng = _data(shape, 16, seed)
            q, k, v, grad = (rng.standard_normal(shape) for _ in range(4))
            positions = all_positions(length, size, zigzag)
            q, k, v, grad = (a.astype(dtype) for a in (q, k, v, grad))
            whole = _one_process_backward(q, k, v, grad, positions, causal)
            # this rank's rows of each; the inputs in the dtype under test, out and lse from one process
            mine = [take_rows(a, positions[rank]) for a in (q, k, v)]
            out_lse = [np.take(a, positions[rank], axis=a.ndim - (2 if i == 0 else 1)) for i, a in enumerate(whole[:2])]
            given = [*mine, *(a.astype(dtype) for a in out_lse), take_rows(grad, positions[rank])]
            copies = [a.copy() for a in given]
            got, traffic = run_counted(sub, fn, (*copies, positions.copy(), causal), context, timeout=timeout)
            problem = None
            if not isinstance(got, tuple) or len(got) != 3:
                problem = f"return a tuple (dq, dk, dv), got {type(got).__name__}"
            else:
                for name, g, w in zip(("dq", "dk", "dv"), got, whole[2:]):
                    want = np.take(w, positions[rank], axis=-2).astype(dtype)
                    problem = problem or _close_problem(g, want, f"rank {rank}'s {name}")
                if problem is None and any(np.shares_memory(g, a) for g in got for a in copies):
                    problem = "a gradient shares memory with an input: return new arrays"
            if problem is None and any(not np.array_equal(a, b) for a, b in zip(copies, given)):
                problem = "q, k, v, out, lse or grad_out was changed: send copies, or receive into new buffers"
            block = mine[1].nbytes + mine[2].nbytes
            found = problem or _backward_messages_problem(traffic, rank, size, block)
            fail_together(sub, found and f"{context}: {found}", f"ring attention backward on {size} ranks")
        return None

    each_size(comm, body, "ring attention backward", _world_first(comm), draw=draw)
    passed(comm, f"ring attention backward: every rank's dq, dk, dv equal autograd's on one process{named(draw)}")


def _backward_messages_problem(traffic: list[Traffic], rank: int, size: int, block_bytes: int) -> str | None:
    """Only to the next rank; P-1 blocks of K and V and P blocks of their gradients (dK and dV) in all."""
    mine = traffic[rank]
    neighbours = _neighbour_problem(mine, rank, size)
    if neighbours:
        return neighbours
    want = (2 * size - 1) * block_bytes if size > 1 else 0
    if mine.bytes_sent != want:
        return (
            f"rank {rank} sent {mine.bytes_sent} bytes, the backward ring sends {want}: {size - 1} blocks of K and V "
            f"and {size if size > 1 else 0} blocks of their gradients, each {block_bytes} bytes"
        )
    if any(e.tag == COLLECTIVE_TAG for e in mine.events):
        return "called a collective: the ring is point-to-point messages only"
    return None


def ulysses_cases(size: int, draw: Draw | None = None) -> list[tuple[int, int, int, bool, str]]:
    """(heads, length, head width, zig-zag layout?, dtype) of check_ulysses's cases on `size` ranks.

    The grader's draw: heads a multiple of P (P to 3P), lengths a multiple of 2P (up to 12P), one that is not
    and one shorter than 2P, widths 1 to 6, both layouts and both dtypes."""
    if draw is None:
        return [
            (size, 4 * size, 3, False, "float64"),
            (2 * size, 4 * size + 3, 3, True, "float64"),
            (2 * size, 2 * size + 1, 3, False, "float32"),
        ]
    lengths = [
        2 * size * draw.integer(1, 6, "divides", size),
        2 * size * draw.integer(0, 5, "chunks", size) + draw.integer(1, 2 * size - 1, "remainder", size),
        draw.integer(1, 2 * size - 1, "short", size),
    ]
    cases = []
    for index, length in enumerate(lengths):
        shape, zigzag, dtype = _drawn_case(draw, size, index, length)
        cases.append((size * draw.integer(1, 3, "heads", size, index), length, shape[-1], zigzag, dtype))
    return cases


def check_ulysses(fn: Callable[..., np.ndarray], timeout: float = DEADLINE) -> None:
    """fn(comm, q, k, v, positions) -> this rank's rows (H, n, d) of causal attention, by a head split.

    The grader's draw: the ranks of every sub-communicator (any P of the world's, in any order), the cases
    of ulysses_cases (heads, lengths, widths, layouts, float64 and float32) and the inputs' data seeds."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "ulysses")

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        for index, (heads, length, width, zigzag, dtype) in enumerate(ulysses_cases(size, draw)):
            layout = "zig-zag" if zigzag else "contiguous"
            seed = None if draw is None else draw.data_seed("ulysses", size, index)
            context = f"Ulysses, {heads} heads of {length} positions in {dtype}, {layout} layout"
            if draw is not None:
                context = f"Ulysses, {heads} heads of {length} positions of width {width} in {dtype}, {layout} layout"
                context += _seeded(draw, seed)
            rng = np.random.default_rng([heads, length, 17] if seed is None else seed)
            q, k, v = (rng.standard_normal((heads, length, width)).astype(dtype) for _ in range(3))
            positions = all_positions(length, size, zigzag)
            mine = [take_rows(a, positions[rank]) for a in (q, k, v)]
            copies = [a.copy() for a in mine]
            got, traffic = run_counted(
                sub, fn, (*copies, positions.copy()), context, timeout=timeout, allow=("Alltoall",)
            )
            q_whole, k_whole, v_whole = (_padded_whole(a, positions).astype(np.float64) for a in (q, k, v))
            want = np.take(reference_attention(q_whole, k_whole, v_whole)[0], positions[rank], axis=-2).astype(dtype)
            real = positions[rank] < length
            problem = _close_problem(_real_rows(got, want, real, True), want, f"rank {rank}'s output")
            if problem is None and any(np.shares_memory(got, a) for a in copies):
                problem = "the output shares memory with an input: return a new array"
            if problem is None and any(not np.array_equal(a, b) for a, b in zip(copies, mine)):
                problem = "q, k or v was changed: leave the inputs alone"
            if problem is None:
                mine_traffic = traffic[rank]
                each = mine[0].nbytes // size  # one rank's share of one tensor: its heads of my rows
                if mine_traffic.calls != ["Alltoall"] * 4:
                    problem = (
                        f"called {', '.join(mine_traffic.calls) or 'no collective'}: expected exactly four Alltoalls "
                        "(q, k and v to the head split, the output back)"
                    )
                elif any(e.tag != COLLECTIVE_TAG for e in mine_traffic.events):
                    problem = "sent point-to-point messages: the four Alltoalls carry everything"
                elif [e.nbytes for e in mine_traffic.sends] != [each] * (4 * size):
                    problem = (
                        f"its Alltoalls send {[e.nbytes for e in mine_traffic.sends]} bytes, {each} to each rank each"
                    )
            fail_together(sub, problem and f"{context}: {problem}", f"Ulysses on {size} ranks")
        return None

    each_size(comm, body, "Ulysses", _world_first(comm), draw=draw)
    passed(comm, f"Ulysses: four Alltoalls, and every rank's rows equal one process's{named(draw)}")


ZIGZAG_HINT = (
    "(pad x with zero rows to a multiple of 2*size, cut it into 2*size chunks of equal length; rank r holds "
    "chunk r, then chunk 2*size-1-r; unsplit puts them back and drops the padding)"
)


def _zigzag_problem(
    split: Callable[[np.ndarray, int, int], np.ndarray],
    unsplit: Callable[[list[np.ndarray], int], np.ndarray],
    size: int,
    shape: tuple[int, ...],
    dtype: str = "float64",
    seed: int | None = None,
) -> str | None:
    """What is wrong with split and unsplit for one sequence on `size` ranks, on one process (`seed`: the data's,
    drawn by the grader)."""
    length = shape[-2]
    context = f"{length} positions of shape {shape} in {dtype} on {size} ranks"
    if seed is not None:
        context += f", data seed {seed}"
    x = _data(shape, size, seed).standard_normal(shape).astype(dtype)
    positions = all_positions(length, size)
    parts = []
    for rank in range(size):
        given_x = x.copy()
        got, problem = _timed_call(split, given_x, size, rank, what=f"split(x, {size}, {rank})")
        problem = problem or _close_problem(got, take_rows(x, positions[rank]), f"rank {rank}'s split")
        if problem is None and np.shares_memory(got, given_x):
            problem = f"rank {rank}'s split shares memory with x: return a new array"
        if problem:
            return f"{context}: {problem}"
        parts.append(got)
    given = [p.copy() for p in parts]
    back, problem = _timed_call(unsplit, given, length, what="unsplit")
    problem = problem or _close_problem(back, x, "unsplit")
    if problem is None and any(np.shares_memory(back, p) for p in given):
        problem = "unsplit shares memory with a part: return a new array"
    return problem and f"{context}: {problem}"


def zigzag_cases(draw: Draw | None = None) -> list[tuple[int, tuple[int, ...], str, int | None]]:
    """(ranks, shape, dtype, data seed or None) of check_zigzag's one-process cases.

    The grader's draw: four rank counts of 1 to 8, each with a drawn case of CASES (lengths a multiple of 2P,
    not, shorter than 2P and anywhere up to 12P; leading axes, widths, float64 and float32) and its data seed."""
    if draw is None:
        return [
            (size, shape, dtype, None)
            for size in (1, 2, 3, 4)
            for shape, dtype in (
                ((8 * size, 2), "float64"),
                ((8 * size + 3, 2), "float64"),
                ((1, 3), "float64"),
                ((2, 2 * size - 1, 2), "float64"),
                ((3, 2, 4 * size + 1, 2), "float32"),
            )
        ]
    return [
        (size, shape, dtype, draw.data_seed("zigzag", size, index))
        for size in draw.lengths(4, 1, 8, "sizes")
        for index, (shape, _, dtype) in enumerate(CASES(size, draw))
    ]


def _zigzag_one_process(
    split: Callable[[np.ndarray, int, int], np.ndarray],
    unsplit: Callable[[list[np.ndarray], int], np.ndarray],
    draw: Draw | None = None,
) -> str | None:
    """The first problem of split and unsplit on one process, for zigzag_cases' sequences, or None."""
    for size, shape, dtype, seed in zigzag_cases(draw):
        problem = _zigzag_problem(split, unsplit, size, shape, dtype, seed)
        if problem:
            return problem + named(draw)
    return None


def check_zigzag(
    split: Callable[[np.ndarray, int, int], np.ndarray], unsplit: Callable[[list[np.ndarray], int], np.ndarray]
) -> None:
    """split(x, size, rank) -> rank's rows; unsplit(parts, length) -> x: one process, then ring attention on P ranks.

    Any array of the right shape, dtype and values is a valid split, contiguous or not (index arrays with
    leading axes give a non-contiguous one): the check hands the ring C-contiguous copies. Every rank agrees
    on the one-process verdict before the ring's collectives, and each call has a deadline.

    The grader's draw: the one-process cases of zigzag_cases; around the ring, the ranks of every
    sub-communicator (any P of the world's, in any order), the length (1 to 12P) and the data's seed."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "zigzag")
    problem = _zigzag_one_process(split, unsplit, draw)
    fail_together_once(comm, problem, "zig-zag on one process", ZIGZAG_HINT)

    def body(sub: MPI.Comm) -> str | None:  # the split and unsplit around ring attention on P ranks
        rank, size = sub.Get_rank(), sub.Get_size()
        length = 6 * size + 1 if draw is None else draw.integer(1, 12 * size, "ring length", size)
        seed = None if draw is None else draw.data_seed("ring", size)
        q, k, v = (
            np.random.default_rng([length, i] if seed is None else [seed, i]).standard_normal((2, length, 3))
            for i in range(3)
        )
        positions = all_positions(length, size)
        context = f"zig-zag split of {length} positions on {size} ranks{_seeded(draw, seed)}"
        mine, problem = [], None
        for a in (q, k, v):
            got, problem = _timed_call(split, a.copy(), size, rank, what=f"split(x, {size}, {rank})")
            problem = problem or _close_problem(got, take_rows(a, positions[rank]), f"rank {rank}'s split")
            if problem:
                break
            mine.append(np.ascontiguousarray(got).copy())  # the ring's buffers: any valid layout will do
        fail_together(sub, problem, context, ZIGZAG_HINT)  # before the ring, which needs all ranks
        (out, _), _ = run_counted(sub, ring_attention, (*mine, positions), f"ring attention on your {context}")
        back, problem = _timed_call(unsplit, sub.allgather(out), length, what="unsplit")
        problem = problem or _close_problem(back, reference_attention(q, k, v)[0], "unsplit of the ranks' outputs")
        return problem and (problem if draw is None else f"{context}: {problem}")

    each_size(comm, body, "zig-zag split around ring attention", draw=draw)
    passed(comm, f"zig-zag: each rank holds chunks r and 2P-1-r, padded; unsplit restores the sequence{named(draw)}")

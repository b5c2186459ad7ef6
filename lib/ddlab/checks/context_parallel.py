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
"""

from __future__ import annotations

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
from .errors import CheckFailed

#: Tolerance of every comparison with one process (float64).
TOLERANCE = 1e-10
#: Seconds a ring may wait for a block before the check calls it a deadlock.
DEADLINE = 10.0


#: Relative tolerance of a float32 answer against float64 computed from the same inputs.
TOLERANCE32 = 1e-5


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
        _, first, second = _merge_cases()[0]
        got, problem = _timed_call(fn, *(a.copy() for a in (*first, *second)), what="merge")
        attention = reference_attention(*_merge_inputs())[0]
        if problem is None and not np.allclose(got[0] / got[2][..., None], attention, rtol=0, atol=TOLERANCE):
            problem = "the merged result, divided by l, is not the causal attention over both blocks"
    fail_together_once(  # every rank ran the same cases: one verdict, said once unless the ranks differ
        comm,
        problem,
        "merge_partials",
        "(rescale each partial's o and l by exp(its m - the new m), the new m being the larger; a row where both "
        "m are -inf has seen nothing: keep it 0, -inf, 0)",
    )
    passed(comm, "merge_partials: two partial attention results merge exactly, empty rows included")


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


def CASES(size: int) -> list[tuple[tuple[int, ...], bool, str]]:
    """(shape, zig-zag layout?, dtype) of the ring checks' inputs on `size` ranks: 2P divides the length or not,
    leading axes or none, float64 and float32."""
    return [
        ((4 * size, 3), True, "float64"),
        ((2, 2, 4 * size + 3, 4), True, "float64"),
        ((4 * size + 1, 2), False, "float64"),
        ((2, 4 * size + 1, 3), True, "float32"),
    ]


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
        for shape, zigzag, dtype in CASES(size):
            length = shape[-2]
            layout = "zig-zag" if zigzag else "contiguous"
            context = f"ring attention, {length} positions of shape {shape} in {dtype}, {layout} layout"
            rng = np.random.default_rng([*shape, 15])
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

    each_size(comm, body, "ring attention", _world_first(comm))
    passed(comm, "ring attention: every rank's rows equal one process's, in P-1 steps of K and V round the ring")


def _padded_whole(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x with zero rows appended up to every position in `positions` (the padded sequence)."""
    return take_rows(x, np.arange(positions.size))


def BACKWARD_CASES(size: int) -> list[tuple[tuple[int, ...], bool, str, bool]]:
    """(shape, zig-zag layout?, dtype, causal?) of the backward check's inputs on `size` ranks: the forward's
    causal cases, then non-causal ones at lengths 2P divides (no padding key for a query to see)."""
    return [
        *((shape, zigzag, dtype, True) for shape, zigzag, dtype in CASES(size)),
        ((2, 4 * size, 3), True, "float64", False),
        ((4 * size, 2), False, "float32", False),
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
    """fn(comm, q, k, v, out, lse, grad_out, positions, causal) -> (dq, dk, dv) of this rank's rows, as autograd gives."""
    comm = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        for shape, zigzag, dtype, causal in BACKWARD_CASES(size):
            length = shape[-2]
            layout = "zig-zag" if zigzag else "contiguous"
            context = (
                f"ring attention backward, {'causal' if causal else 'not causal'}, {length} positions of shape "
                f"{shape} in {dtype}, {layout} layout"
            )
            rng = np.random.default_rng([*shape, 16])
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

    each_size(comm, body, "ring attention backward", _world_first(comm))
    passed(comm, "ring attention backward: every rank's dq, dk, dv equal autograd's on one process")


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


def check_ulysses(fn: Callable[..., np.ndarray], timeout: float = DEADLINE) -> None:
    """fn(comm, q, k, v, positions) -> this rank's rows (H, n, d) of causal attention, by a head split."""
    comm = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        for heads, length, zigzag, dtype in (
            (size, 4 * size, False, "float64"),
            (2 * size, 4 * size + 3, True, "float64"),
            (2 * size, 2 * size + 1, False, "float32"),
        ):
            layout = "zig-zag" if zigzag else "contiguous"
            context = f"Ulysses, {heads} heads of {length} positions in {dtype}, {layout} layout"
            rng = np.random.default_rng([heads, length, 17])
            q, k, v = (rng.standard_normal((heads, length, 3)).astype(dtype) for _ in range(3))
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

    each_size(comm, body, "Ulysses", _world_first(comm))
    passed(comm, "Ulysses: four Alltoalls, and every rank's rows equal one process's")


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
) -> str | None:
    """What is wrong with split and unsplit for one sequence on `size` ranks, on one process."""
    length = shape[-2]
    context = f"{length} positions of shape {shape} in {dtype} on {size} ranks"
    x = np.random.default_rng([*shape, size]).standard_normal(shape).astype(dtype)
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


def _zigzag_one_process(
    split: Callable[[np.ndarray, int, int], np.ndarray], unsplit: Callable[[list[np.ndarray], int], np.ndarray]
) -> str | None:
    """The first problem of split and unsplit on one process, for 1 to 4 ranks' worth of sequences, or None."""
    for size in (1, 2, 3, 4):
        for shape, dtype in (
            ((8 * size, 2), "float64"),
            ((8 * size + 3, 2), "float64"),
            ((1, 3), "float64"),
            ((2, 2 * size - 1, 2), "float64"),
            ((3, 2, 4 * size + 1, 2), "float32"),
        ):
            problem = _zigzag_problem(split, unsplit, size, shape, dtype)
            if problem:
                return problem
    return None


def check_zigzag(
    split: Callable[[np.ndarray, int, int], np.ndarray], unsplit: Callable[[list[np.ndarray], int], np.ndarray]
) -> None:
    """split(x, size, rank) -> rank's rows; unsplit(parts, length) -> x: one process, then ring attention on P ranks.

    Any array of the right shape, dtype and values is a valid split, contiguous or not (index arrays with
    leading axes give a non-contiguous one): the check hands the ring C-contiguous copies. Every rank agrees
    on the one-process verdict before the ring's collectives, and each call has a deadline."""
    comm = MPI.COMM_WORLD
    problem = _zigzag_one_process(split, unsplit)
    fail_together_once(comm, problem, "zig-zag on one process", ZIGZAG_HINT)

    def body(sub: MPI.Comm) -> str | None:  # the split and unsplit around ring attention on P ranks
        rank, size = sub.Get_rank(), sub.Get_size()
        length = 6 * size + 1
        q, k, v = (np.random.default_rng([length, i]).standard_normal((2, length, 3)) for i in range(3))
        positions = all_positions(length, size)
        context = f"zig-zag split of {length} positions on {size} ranks"
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
        return problem or _close_problem(back, reference_attention(q, k, v)[0], "unsplit of the ranks' outputs")

    each_size(comm, body, "zig-zag split around ring attention")
    passed(comm, "zig-zag: each rank holds chunks r and 2P-1-r, padded; unsplit restores the sequence")

"""Checks for lab 03: a hand-written allreduce must give the sum, and send the right messages.

Each check runs the student's function on the first P ranks for every P up to the
world's size, over lengths that do and do not divide by P and three dtypes, through
a CountingComm. It compares every rank's result with the exact sum (inputs are small
integers, so any order of addition gives the same answer), then holds the recorded
messages against the algorithm: who sends to whom, how many messages, how many bytes.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..allreduce import largest_power_of_two, member_rank
from ..runtime.counting import Traffic
from ._core import CheckFailed, array_problem, count, each_size, fail_together, passed, run_counted
from ._draw import Draw, grading_draw

DTYPES = (np.float64, np.float32, np.int64)
#: The dtypes the grader draws from (the contract: any dtype, the same on every rank); sums stay exact.
DRAWN_DTYPES = (np.float64, np.float32, np.int64, np.int32, np.int16)
#: Seconds a rank may stall inside the student's allreduce before the check calls it a deadlock.
TIMEOUT = 20.0

Rule = Callable[[list[Traffic], int, int, int], "str | None"]


def _lengths(size: int, draw: Draw | None = None) -> tuple[int, ...]:
    """Empty, one item, fewer items than ranks, a multiple of P, and one that is not.

    The grader's draw keeps 0 and draws the others: one below P, a multiple of P and one that is not
    (up to 40 P), and one more anywhere up to 40 P + 7."""
    if draw is None:
        return (0, 1, 7, 12 * size, 12 * size + 5)
    multiple = size * draw.integer(2, 40, "multiple", size)
    other = multiple + draw.integer(1, size - 1, "remainder", size) if size > 1 else multiple + 1
    return (
        0,
        draw.integer(1, max(1, size - 1), "small", size),
        multiple,
        other,
        draw.integer(1, 40 * size + 7, "any", size),
    )


def _inputs(n: int, dtype: type, size: int, seed: int | None = None) -> list[np.ndarray]:
    """Every rank's input: small integers, so sums are exact in float32 (and int16) too; `seed`: the grader's."""
    keys = [n, size] if seed is None else [n, size, seed]
    return [np.random.default_rng([*keys, rank]).integers(-50, 50, n).astype(dtype) for rank in range(size)]


def value_problem(result: object, x: np.ndarray, before: np.ndarray, want: np.ndarray, rank: int) -> str | None:
    """What breaks lab 03's contract: the sum `want` in a new array, `x` left as `before`."""
    if result is x or (isinstance(result, np.ndarray) and np.shares_memory(result, x)):
        return "the result shares memory with x: return a new array and leave x as it was"
    return array_problem(x, before, f"x on rank {rank} after the call (it must not change)") or array_problem(
        result, want, f"the result on rank {rank}"
    )


def _shown(sends: list[tuple[int, int]]) -> str:
    text = ", ".join(f"to {peer} ({nbytes} B)" for peer, nbytes in sends[:6])
    return (text + (", ..." if len(sends) > 6 else "")) or "nothing"


def _sends(t: Traffic) -> list[tuple[int, int]]:
    return [(e.peer, e.nbytes) for e in t.sends]


# Who sends what, algorithm by algorithm ----------------------------------------------


def _fold_note(size: int) -> str:
    pof2 = largest_power_of_two(size)
    if pof2 == size:
        return ""
    extra = size - pof2
    return (
        f" P={size} is not a power of two, so ranks 0..{2 * extra - 1} fold in first (each even "
        f"rank sends its whole vector to the odd rank after it and sits out) and the odd ones send "
        f"the result back at the end; the other p'={pof2} ranks do the algorithm."
    )


def _group(rank: int, size: int) -> int | None:
    """This rank's member number in the power-of-two group, None if it sits out (fold_in's rule)."""
    extra = size - largest_power_of_two(size)
    if rank >= 2 * extra:
        return rank - extra
    return rank // 2 if rank % 2 else None


def recursive_doubling_sends(rank: int, size: int, nbytes: int) -> list[tuple[int, int]]:
    """(peer, bytes) of every message recursive doubling sends from `rank`, in order."""
    group, pof2 = _group(rank, size), largest_power_of_two(size)
    if group is None:
        return [(rank + 1, nbytes)]
    core = [(member_rank(group ^ (1 << k), size), nbytes) for k in range(pof2.bit_length() - 1)]
    return core + ([(rank - 1, nbytes)] if rank < 2 * (size - pof2) else [])


def recursive_doubling_problem(traffic: list[Traffic], size: int, n: int, itemsize: int) -> str | None:
    """None if every rank sent log2 p' whole vectors to partners rank XOR 2^k (plus the fold)."""
    pof2 = largest_power_of_two(size)
    for t in traffic:
        want = recursive_doubling_sends(t.rank, size, n * itemsize)
        if _sends(t) != want:
            steps = pof2.bit_length() - 1
            return (
                f"rank {t.rank} sent {t.messages_sent} messages: {_shown(_sends(t))}. Recursive doubling "
                f"on {pof2} ranks sends log2({pof2}) = {count(steps, 'message')} of all n = {n} "
                f"items ({n * itemsize} B), in step k to the {'member' if pof2 < size else 'rank'} whose "
                f"number differs in bit k (number XOR 2^k).{_fold_note(size)} "
                f"Expected from rank {t.rank}: {_shown(want)}."
            )
    return None


def ring_problem(traffic: list[Traffic], size: int, n: int, itemsize: int) -> str | None:
    """None if every rank sent 2(P-1) chunks, each to its right neighbour, 2(P-1) n items in all."""
    largest = math.ceil(n / size) * itemsize
    for t in traffic:
        right, left = (t.rank + 1) % size, (t.rank - 1) % size
        if t.messages_sent != 2 * (size - 1):
            return (
                f"rank {t.rank} sent {t.messages_sent} messages; a ring on P={size} ranks sends "
                f"2(P-1) = {2 * (size - 1)}: P-1 in the reduce-scatter and P-1 in the allgather, one chunk each"
            )
        elsewhere = [e.peer for e in t.sends if e.peer != right]
        if elsewhere:
            return (
                f"rank {t.rank} sent a message to rank {elsewhere[0]}; in a ring every rank sends "
                f"only to its right neighbour, rank {right}, and receives only from its left, rank {left}"
            )
        strangers = [e.peer for e in t.recvs if e.peer != left]
        if strangers:
            return f"rank {t.rank} received from rank {strangers[0]}; in a ring it receives only from rank {left}"
        big = [e.nbytes for e in t.sends if e.nbytes > largest]
        if big:
            return (
                f"rank {t.rank} sent a message of {big[0]} B; a ring passes one chunk per message, at most "
                f"ceil(n/P) = {math.ceil(n / size)} items ({largest} B), never the whole vector"
            )
    total, want = sum(t.bytes_sent for t in traffic), 2 * (size - 1) * n * itemsize
    if total != want:
        return (
            f"all ranks together sent {total} B; a ring passes each of the P chunks P-1 times in "
            f"each phase: 2(P-1) n = {2 * (size - 1) * n} items, {want} B"
        )
    return None


def rabenseifner_problem(traffic: list[Traffic], size: int, n: int, itemsize: int) -> str | None:
    """None if each group member sent 2 log2 p' messages to partners one bit away, near 2(p'-1)/p' n items."""
    pof2, extra = largest_power_of_two(size), size - largest_power_of_two(size)
    steps = pof2.bit_length() - 1
    core_total = 0
    for t in traffic:
        group, sends = _group(t.rank, size), _sends(t)
        folded = t.rank < 2 * extra
        want = 1 if group is None else 2 * steps + folded
        if len(sends) != want:
            return (
                f"rank {t.rank} sent {len(sends)} messages: {_shown(sends)}. Rabenseifner's algorithm on "
                f"{pof2} ranks sends 2 log2({pof2}) = {2 * steps}: {steps} halving the data in the "
                f"reduce-scatter, {steps} doubling it in the allgather.{_fold_note(size)}"
            )
        if folded:
            fold = [(t.rank + 1, n * itemsize)] if group is None else [(t.rank - 1, n * itemsize)]
            if (sends[:1] if group is None else sends[-1:]) != fold:
                return f"rank {t.rank} sent {_shown(sends)}; the fold should send {_shown(fold)}.{_fold_note(size)}"
            if group is None:
                continue
            sends = sends[:-1]
        for peer, _ in sends:
            other = _group(peer, size) if 0 <= peer < size else None
            if group is None or other is None or bin(other ^ group).count("1") != 1:
                return (
                    f"rank {t.rank} (member {group} of the {pof2}-rank group) sent to rank {peer}; each "
                    f"step pairs members whose numbers differ in one bit (member XOR distance)."
                    f"{_fold_note(size)}"
                )
        sent = sum(nbytes for _, nbytes in sends)
        bound = 2 * (pof2 - 1) * math.ceil(n / pof2) * itemsize
        if sent > bound:
            return (
                f"rank {t.rank} sent {sent} B in the reduce-scatter and allgather; halving the data at "
                f"each step sends 2(p'-1)/p' n = {2 * (pof2 - 1) * n / pof2:.0f} items "
                f"(about {bound} B), not whole vectors"
            )
        core_total += sent
    want_total = 2 * (pof2 - 1) * n * itemsize
    if core_total != want_total:
        return (
            f"the {pof2} group members together sent {core_total} B in the reduce-scatter and allgather; "
            f"recursive halving and doubling move 2(p'-1) n = {2 * (pof2 - 1) * n} items, {want_total} B"
        )
    return None


# Running the cases -----------------------------------------------------------------


def _one_case(
    comm: MPI.Comm, fn: Callable, name: str, rule: Rule, n: int, dtype: type, timeout: float, draw: Draw | None = None
) -> None:
    """Run fn on comm for one length and dtype; raise CheckFailed (on every rank of comm) if wrong."""
    rank, size = comm.Get_rank(), comm.Get_size()
    seed = None if draw is None else draw.data_seed(n, size, np.dtype(dtype).name)
    inputs = _inputs(n, dtype, size, seed)
    x = inputs[rank]
    before = x.copy()
    where = f"{name} on P={size} ranks, x of length {n} ({np.dtype(dtype).name})"
    if draw is not None:
        where += f", data seed {seed} ({draw})"
    result, traffic = run_counted(comm, fn, (x,), where, timeout)
    fail_together(
        comm, value_problem(result, x, before, sum(inputs[1:], inputs[0].copy()), rank), f"{where}: wrong result"
    )
    if n >= size:  # smaller vectors leave chunks empty; their messages may be skipped
        problem = rule(traffic, size, n, np.dtype(dtype).itemsize)
        if problem:
            raise CheckFailed(f"{where}: right values, wrong messages:\n  {problem}")


def _check(fn: Callable, name: str, rule: Rule, comm: MPI.Comm | None, timeout: float) -> str:
    """Run every case on sub-communicators of 1..P ranks (a rank stalled `timeout` s fails); return the scope.

    Under the grader's draw (ddlab.checks._draw): drawn ranks, lengths, three drawn dtypes and data."""
    world = comm or MPI.COMM_WORLD
    draw = grading_draw(world, name)
    dtypes = DTYPES if draw is None else _drawn_dtypes(draw)

    def every_case(sub: MPI.Comm) -> None:
        for dtype in dtypes:
            for n in _lengths(sub.Get_size(), draw):
                _one_case(sub, fn, name, rule, n, dtype, timeout, draw)

    each_size(world, every_case, name, draw=draw)
    return _scope(world.Get_size(), dtypes, draw)


def _drawn_dtypes(draw: Draw) -> tuple[type, ...]:
    """Three dtypes: two of the notebook's and one it never shows, so an answer fitted to its dtypes always fails."""
    shown = [d for d in DRAWN_DTYPES if d in DTYPES]
    return tuple(draw.choose(shown, 2, "dtypes") + draw.choose([d for d in DRAWN_DTYPES if d not in DTYPES], 1, "new"))


def _scope(size: int, dtypes: tuple[type, ...], draw: Draw | None) -> str:
    names = ", ".join(np.dtype(d).name for d in dtypes)
    if draw is None:
        return f"on 1..{size} ranks, for lengths 0 to {12 * size + 5} and {names}"
    return f"on 1..{size} drawn ranks, for drawn lengths and {names} ({draw})"


def check_allreduce_recursive_doubling(fn: Callable, comm: MPI.Comm | None = None, timeout: float = TIMEOUT) -> None:
    """fn(comm, x) must sum like allreduce, swapping whole vectors with partner rank XOR 2^k."""
    scope = _check(fn, "allreduce_recursive_doubling", recursive_doubling_problem, comm, timeout)
    passed(
        comm or MPI.COMM_WORLD,
        f"allreduce_recursive_doubling sums correctly {scope}; each rank "
        "sends log2 P whole vectors to partners rank XOR 2^k (with the fold when P is not a power of two)",
    )


def check_allreduce_ring(fn: Callable, comm: MPI.Comm | None = None, timeout: float = TIMEOUT) -> None:
    """fn(comm, x) must sum like allreduce, passing 2(P-1) chunks of n/P items around the ring."""
    scope = _check(fn, "allreduce_ring", ring_problem, comm, timeout)
    passed(
        comm or MPI.COMM_WORLD,
        f"allreduce_ring sums correctly {scope}; each rank sends 2(P-1) "
        "chunks to its right neighbour, 2(P-1)/P n items in all: the bandwidth lower bound",
    )


def check_allreduce_rabenseifner(fn: Callable, comm: MPI.Comm | None = None, timeout: float = TIMEOUT) -> None:
    """fn(comm, x) must sum like allreduce by recursive halving, then recursive doubling."""
    scope = _check(fn, "allreduce_rabenseifner", rabenseifner_problem, comm, timeout)
    passed(
        comm or MPI.COMM_WORLD,
        f"allreduce_rabenseifner sums correctly {scope}; each rank sends "
        "2 log2 P messages, 2(P-1)/P n items in all: the bandwidth lower bound in few messages",
    )

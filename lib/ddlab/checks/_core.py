"""What every check shares: run a student's collective safely, agree on failures, report."""

from __future__ import annotations

import contextlib
import numbers
import signal
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from mpi4py import MPI

from ..runtime.comm import drain, first_ranks
from ..runtime.counting import CountingComm, Traffic, gather_traffic
from ..runtime.reference import ReferenceCalled
from ._draw import Draw
from .errors import CheckFailed

MPI_ERROR_HINT = (
    "an error inside MPI: most often the ranks' collective calls did not match (a different "
    "collective, or the same ones in another order or with other sizes), or a receive buffer was "
    "smaller than its message"
)


def count(n: int, noun: str) -> str:
    """'1 rank', '3 ranks': n and the noun, plural unless n is 1."""
    return f"{n} {noun}{'s' * (n != 1)}"


class _Expired(BaseException):
    """What `deadline` raises in the body: not an Exception, so that an answer's `except Exception` (around a
    call that might fail, inside a loop) lets it through."""


@contextlib.contextmanager
def deadline(seconds: float, what: str, cause: str = "a loop that never ends?") -> Iterator[None]:
    """CheckFailed naming `what` and the likely `cause` if the body runs longer than `seconds`.

    The one time limit of the checks that call student code on one process (no communicator's timeout
    covers it). It interrupts the main thread only (a signal); elsewhere nothing can, and there is no limit.
    The interruption is not an Exception, and a body that caught it all the same (a bare `except:`) and then
    returned or raised fails as if it had not; only a loop that catches everything forever is beyond it."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    expired = False

    def expire(signum: int, frame: Any) -> None:
        nonlocal expired
        expired = True
        raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except BaseException:
        if not expired:
            raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if expired:
        raise CheckFailed(f"{what} did not return within {seconds:.0f} s: {cause}") from None


def fail_together(comm: MPI.Comm, problem: str | None, context: str, hint: str = "") -> None:
    """Raise the same CheckFailed on every rank if any rank found a problem (hint: what to do, appended)."""
    _raise_found(comm.allgather(problem), context, hint)


def fail_together_once(comm: MPI.Comm, problem: str | None, context: str, hint: str = "") -> None:
    """fail_together for a problem every rank finds alike (one process's work, run on each): said once
    ("on every rank") when all ranks found the same text, one line per rank as fail_together when they differ."""
    problems = comm.allgather(problem)
    if problems and all(problems) and len(set(problems)) == 1:
        raise CheckFailed(f"{context} (on every rank):\n  {problems[0]}" + (f"\n{hint}" if hint else ""))
    _raise_found(problems, context, hint)


def each_size(
    comm: MPI.Comm,
    body: Callable[[MPI.Comm], str | None],
    context: str,
    sizes: Sequence[int] | None = None,
    reordered: bool = False,
    draw: Draw | None = None,
) -> None:
    """Run body(sub) on the first P ranks of comm for each P in sizes (default 1..size); one verdict for all.

    The one loop every check uses. body runs on the ranks of each sub-communicator
    and either returns this rank's problem (a string) or None, or raises CheckFailed
    (already the same on every rank of sub), the lab stub's NotImplementedError, or the refusal of
    the library's own answer (ddlab.runtime.reference), which may reach a few ranks only.
    After each size, every rank of comm raises the same error: the stub's first,
    then a CheckFailed, then the ranks' problems listed under `context`. Ranks
    outside a sub-communicator wait for its verdict, so none is left behind.

    Sizes in the order given. Put comm's own size first (as lab 08's and 11's checks do) where
    an answer may call the notebook's MPI.COMM_WORLD instead of the communicator it was given:
    it completes on the whole world, where the body can see that nothing went through its
    communicator, before a smaller one would wait forever for ranks outside it.
    `reordered` runs body once more on all of comm's ranks numbered differently (rank q of
    it is comm's rank q - 1): an answer using the notebook's world `rank` instead of its
    communicator's goes wrong there, as it cannot on the prefixes.
    `draw` (the grader's, ddlab.checks._draw): each sub-communicator of P ranks is P of comm's ranks
    drawn, in a drawn order, instead of the first P; every message names its ranks and the seed.
    """
    order = list(sizes) if sizes is not None else list(range(1, comm.Get_size() + 1))
    with _sub_communicators(comm, order, reordered, draw) as subs:
        for size, sub, where in subs:
            stub = failed = problem = None
            if sub is not None:
                try:
                    problem = body(sub)
                except NotImplementedError as err:
                    stub = str(err) or "not implemented"
                except (CheckFailed, ReferenceCalled) as err:  # a refusal, too, raised on some ranks only
                    failed = str(err)
            outcomes = comm.allgather((stub, failed, problem))
            stubs = [s for s, _, _ in outcomes if s]
            if stubs:
                raise NotImplementedError(stubs[0])
            failures = [f for _, f, _ in outcomes if f]
            if failures:  # on the reordered run, with its hint (a ring by the world's `rank` may stall there)
                hint = "" if not where or where in failures[0] else f"\n(this run's ranks are{where})"
                if draw is not None and where and where != REORDERED:  # name the drawn ranks
                    hint = f"\n(on {count(size, 'rank')}{where})"
                raise CheckFailed(failures[0] + hint)
            _raise_found([p for _, _, p in outcomes], f"{context} on {count(size, 'rank')}{where}")


def _raise_found(problems: list[str | None], context: str, hint: str = "") -> None:
    found = [(rank, text) for rank, text in enumerate(problems) if text]
    if found:
        lines = [f"  rank {rank}: {text}" for rank, text in found[:4]]
        if len(found) > 4:
            lines.append(f"  ... and {len(found) - 4} more ranks")
        if hint:
            lines.append(hint)
        raise CheckFailed(f"{context}:\n" + "\n".join(lines))


def passed(comm: MPI.Comm, message: str) -> None:
    """One line on rank 0 when a check passes."""
    if comm.Get_rank() == 0:
        print(f"passed: {message}")


#: Appended to the context of the reordered run (see each_size).
REORDERED = (
    " numbered differently from the world (rank q here is world rank q - 1): does your code use the "
    "notebook's `rank` instead of `comm.Get_rank()` of the communicator it was given?"
)


#: What a check says when a run on several ranks sent nothing through the communicator it gave.
NOTHING_SENT = (
    "no message went through the communicator the check gave: did your code use the notebook's "
    "global `comm` (or MPI.COMM_WORLD) instead of its `comm` argument?"
)


def reordered_hint(sub: MPI.Comm, comm: MPI.Comm) -> str:
    """The hint for each_size's reordered run of comm (sub's ranks are not comm's), else ""."""
    return f"(this run's ranks are{REORDERED})" if sub.Get_rank() != comm.Get_rank() else ""


@contextlib.contextmanager
def _sub_communicators(
    comm: MPI.Comm, sizes: list[int], reordered: bool = False, draw: Draw | None = None
) -> Iterator[list[tuple[int, MPI.Comm | None, str]]]:
    """(P, the communicator of the first P ranks or None on ranks outside, "") for each P, then the
    reordered one's (size, comm rotated by one, REORDERED) if asked; all freed after. With a draw,
    (P, the communicator of P drawn ranks in a drawn order, " (... the grader's draw ...)")."""
    size, rank = comm.Get_size(), comm.Get_rank()
    subs = [(p, first_ranks(comm, p), "") if draw is None else _drawn_ranks(comm, p, draw) for p in sizes]
    if reordered and size > 1:
        subs.append((size, comm.Split(0, (rank + 1) % size), REORDERED))
    try:
        yield subs
    finally:
        for _, sub, _ in subs:
            if sub is not None:
                sub.Free()


def _drawn_ranks(comm: MPI.Comm, p: int, draw: Draw) -> tuple[int, MPI.Comm | None, str]:
    """(p, the communicator of p of comm's ranks drawn, in the drawn order, or None outside, where)."""
    members = draw.ranks(comm.Get_size(), p)
    rank = comm.Get_rank()
    sub = comm.Split(0 if rank in members else MPI.UNDEFINED, members.index(rank) if rank in members else 0)
    listed = ", ".join(map(str, members))
    where = f": {'ranks' if p > 1 else 'rank'} {listed} of the check's communicator, in that order ({draw})"
    return p, None if sub == MPI.COMM_NULL else sub, where


def run_counted(
    comm: MPI.Comm,
    fn: Callable[..., Any],
    args: tuple,
    context: str,
    timeout: float = 20.0,
    allow: tuple[str, ...] = (),
    stagger: float = 0.0,
    on_send: Callable[[int, int], None] | None = None,
) -> tuple[Any, list[Traffic]]:
    """Call fn(counting_comm, *args) on every rank of comm; return (result, all ranks' traffic).

    `allow` names MPI collectives the exercise may call (see CountingComm); others are refused.
    `stagger` > 0 makes messages to one receiver arrive in reverse rank order (see CountingComm).
    `on_send(peer, tag)` is called as fn makes each send (see CountingComm).

    An exercise stub's NotImplementedError on any rank is raised on every rank (the
    others may have failed otherwise meanwhile, e.g. a server whose workers are stubs).
    Any other exception, a stall (of a blocking call, or of a request fn waits for), a
    request fn never waited for, or a forbidden collective on any rank becomes one
    CheckFailed on every rank. Every rank takes the same collective calls whatever
    happened, so no outcome can leave ranks waiting in different collectives. Afterwards no
    message of fn's is left on comm for the caller's next receive to match (`drain`): one a
    peer sent after this rank gave up its receive (a failure elsewhere, a deadline), or one
    nobody ever received; each rank's `Traffic.unreceived` lists them.
    """
    counting = CountingComm(comm, timeout=timeout, allow=allow, stagger=stagger, on_send=on_send)
    stub, problem, result = None, None, None
    try:
        result = fn(counting, *args)
    except NotImplementedError as err:  # the lab's stub: not done, whatever the other ranks met
        stub = str(err) or "not implemented"
        problem = f"NotImplementedError: {stub}"
    except Exception as err:  # the student's code failed: tell the others, report it
        problem = f"{type(err).__name__}: {err}"
        if isinstance(err, MPI.Exception):
            problem += f" ({MPI_ERROR_HINT})"
    else:
        problem = counting.unwaited()
    if counting.watch.failure is not None and stub is None:  # a request of fn's gave up (or a peer failed): the cause
        kind, message = counting.watch.failure
        problem = f"{kind.__name__}: {message}"
    if problem is not None:
        counting.fail_all(problem)
    comm.Barrier()
    left = drain(comm, timeout)
    counting.traffic.unreceived = [(found.source, found.tag) for found in left if found.tag is not None]
    counting.watch.settle()  # notices still in flight taken in: one left on a freed communicator reaches the next given its id
    counting.free()
    outcomes = comm.allgather((stub, problem))
    stubs = [s for s, _ in outcomes if s is not None]
    if stubs:
        raise NotImplementedError(stubs[0])
    _raise_found([p for _, p in outcomes], f"{context} raised an error")
    return result, gather_traffic(counting)


def is_integer(x: Any) -> bool:
    """An int as the lab means it: Python's or NumPy's, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def is_number(x: Any) -> bool:
    """A real number as the lab means it: int or float, Python's or NumPy's, not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def array_problem(got: Any, want: np.ndarray, what: str, *, rtol: float = 1e-6, atol: float = 1e-9) -> str | None:
    """None if `got` equals `want` (same shape, dtype and values; floats within rtol and atol), else what differs."""
    if not isinstance(got, np.ndarray):
        return f"{what} should be a NumPy array, got {type(got).__name__}"
    if got.shape != want.shape:
        return f"{what} has shape {got.shape}, expected {want.shape}"
    if got.dtype != want.dtype:
        return f"{what} has dtype {got.dtype}, expected {want.dtype}"
    close = np.isclose(got, want, rtol=rtol, atol=atol) if want.dtype.kind == "f" else got == want
    if not np.all(close):
        bad = np.flatnonzero(~close)
        shown = ", ".join(f"[{i}] got {got.flat[i]} expected {want.flat[i]}" for i in bad[:3])
        return f"{what} is wrong at {len(bad)} of {want.size} elements: {shown}"
    return None

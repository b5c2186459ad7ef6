"""Checks for lab 01: collecting messages with Status, a deadlock-free exchange, ping-pong, the alpha-beta fit.

The MPI checks run the student's function through a CountingComm, whose blocking
Send never buffers (it waits until the message is received, as a real MPI does for
large arrays), so an exchange that only works thanks to small-message buffering
shows up as a deadlock here rather than on the first big array.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .. import p2p
from ..runtime.comm import Comm
from ..runtime.counting import Event, Traffic
from ._core import CheckFailed, array_problem, count, each_size, passed, run_counted

DEADLOCK_HINT = (
    "If both ranks of a pair call a blocking Send before their Recv, each waits for the other "
    "to receive: a deadlock (here every Send waits for its receiver, as MPI does for large "
    "arrays). Use comm.Sendrecv, or order the calls by rank parity (even ranks send first, odd "
    "ranks receive first), or post Irecv and Isend and then Waitall."
)
SIZE_HINT = (
    "An MPI error in a receive is most often a buffer smaller than the message (MPI_ERR_TRUNCATE). "
    "Rank 0 does not know the lengths: comm.Probe(source=MPI.ANY_SOURCE, status=status) waits for "
    "the next message, then status.Get_source() and status.Get_count(MPI.DOUBLE) say whose it is "
    "and how many float64 it holds."
)
BUFFER_HINT = "send the NumPy array itself with the buffer API (Send/Recv/Sendrecv): lowercase send pickles it"


def _describe(events: list[Event]) -> str:
    """'2 messages: to rank 3 (800 bytes), ...' for error messages."""
    if not events:
        return "no messages"
    shown = ", ".join(
        f"{'to' if e.kind == 'send' else 'from'} "
        f"{'any rank' if e.peer == MPI.ANY_SOURCE else f'rank {e.peer}'} ({e.nbytes} bytes)"
        for e in events[:4]
    )
    more = f", ... ({len(events) - 4} more)" if len(events) > 4 else ""
    return f"{count(len(events), 'message')}: {shown}{more}"


# Exercise: collect -------------------------------------------------------------
STAGGER = 0.1  # seconds between the ranks' first sends, highest rank first


def _collect_data(rank: int) -> np.ndarray:
    """Rank r's float64 array: its own length (0 for some), values r*100 + 0, 1, 2, ..."""
    return np.arange((7 * rank + 5) % 13, dtype=np.float64) + 100.0 * rank


def _collect_problem(sub: MPI.Comm, fn: Callable, timeout: float) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    data = _collect_data(rank)
    try:
        # Arrays arrive in reverse rank order: a list in arrival order is wrong on every run.
        got, traffic = run_counted(sub, fn, (data,), f"collect on {count(size, 'rank')}", timeout, stagger=STAGGER)
    except CheckFailed as err:
        if "MPI_ERR" in str(err):
            raise CheckFailed(f"{err}\n{SIZE_HINT}") from None
        raise
    if rank != 0:
        if got is not None:
            return f"returned {type(got).__name__}, expected None (only rank 0 returns the list)"
        mine = traffic[rank]
        if mine.recvs or len(mine.sends) != 1 or mine.sends[0].peer != 0 or mine.sends[0].nbytes != data.nbytes:
            return f"sent {_describe(mine.sends)} and received {_describe(mine.recvs)}; expected one message of {data.nbytes} bytes to rank 0"
        return None
    if not isinstance(got, (list, tuple)) or len(got) != size:
        length = f" of length {len(got)}" if isinstance(got, (list, tuple)) else ""
        return f"returned {type(got).__name__}{length}, expected a list of {size} arrays, item r from rank r"
    for source in range(size):
        problem = array_problem(got[source], _collect_data(source), f"item {source} (rank {source}'s array)")
        if problem and any(array_problem(got[source], _collect_data(r), "") is None for r in range(size)):
            return (
                f"{problem}: it is another rank's array. Messages may arrive in any order (here: the "
                "highest rank's first); put each at its sender's index (status.Get_source())"
            )
        if problem:
            return problem
    if got[0].size and np.shares_memory(got[0], data):
        return "item 0 is rank 0's data itself: return a copy of it (data.copy()), a new array like the others"
    recvs = traffic[0].recvs
    expected = {source: _collect_data(source).nbytes for source in range(1, size)}
    received = {e.peer: e.nbytes for e in recvs}
    if traffic[0].sends or len(recvs) != size - 1 or received != expected:
        hint = "" if all(e.nbytes == expected.get(e.peer) for e in recvs) else f" ({BUFFER_HINT})"
        return (
            f"received {_describe(recvs)} and sent {_describe(traffic[0].sends)}; expected one message "
            f"from each of ranks 1..{size - 1}, of their arrays' sizes in bytes{hint}"
        )
    return None


def check_collect(fn: Callable[[Any, np.ndarray], list | None], timeout: float = 10.0) -> None:
    """Rank 0 gets every rank's array (of a length it does not know), in a list by rank."""
    comm = MPI.COMM_WORLD
    sizes = list(range(1, comm.Get_size() + 1))
    each_size(comm, lambda sub: _collect_problem(sub, fn, timeout), "collect", sizes)
    passed(comm, "collect receives every rank's array, whatever its length, on rank 0")


# Exercise: exchange ------------------------------------------------------------
EXCHANGE_LENGTH = 2**16 + 3  # about 512 KiB of int64: above every MPI's eager limit


def _exchange_data(rank: int) -> np.ndarray:
    """Rank r's array: 10**6 * (r + 1) + 0, 1, 2, ..., so its owner can be read off.

    Integers, not float64, so that a receive buffer made with NumPy's default dtype fails.
    """
    return np.arange(EXCHANGE_LENGTH, dtype=np.int64) + 10**6 * (rank + 1)


def _owner(got: np.ndarray, size: int) -> int | None:
    """Which rank's array got is, if any."""
    for rank in range(size):
        if got.shape == (EXCHANGE_LENGTH,) and np.array_equal(got, _exchange_data(rank)):
            return rank
    return None


def _exchange_problem(sub: MPI.Comm, fn: Callable, timeout: float) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    partner = rank ^ 1 if rank ^ 1 < size else None
    data = _exchange_data(rank)
    context = f"exchange on {count(size, 'rank')}"
    try:
        got, traffic = run_counted(sub, fn, (data,), context, timeout)
    except CheckFailed as err:
        if "Stalled" in str(err) or "PeerFailed" in str(err):
            raise CheckFailed(f"{err}\n{DEADLOCK_HINT}") from None
        raise
    if not np.array_equal(data, _exchange_data(rank)):
        return "exchange changed its input array: receive into a new array (np.empty_like(data)) instead"
    want = _exchange_data(rank if partner is None else partner)
    whose = (
        "its own array (no partner: the last of an odd number of ranks)"
        if partner is None
        else f"rank {partner}'s array"
    )
    problem = array_problem(got, want, f"the result (expected {whose})")
    if problem:
        owner = _owner(got, size) if isinstance(got, np.ndarray) else None
        return problem if owner is None else f"returned rank {owner}'s array, expected {whose}"
    if np.shares_memory(got, data):
        return "returned data itself (or a view of it): return a new array, e.g. data.copy() for a rank without partner"
    mine = traffic[rank]
    if partner is None:
        if mine.events:
            return f"has no partner and should not communicate, but sent {_describe(mine.sends)} and received {_describe(mine.recvs)}"
        return None
    sends, recvs = mine.sends, mine.recvs
    if len(sends) != 1 or sends[0].peer != partner or sends[0].nbytes != data.nbytes:
        hint = f" ({BUFFER_HINT})" if sends and sends[0].nbytes != data.nbytes else ""
        return (
            f"sent {_describe(sends)}; expected one message of {data.nbytes} bytes to rank {partner} (rank ^ 1){hint}"
        )
    if len(recvs) != 1 or recvs[0].peer not in (partner, MPI.ANY_SOURCE) or recvs[0].nbytes != data.nbytes:
        return f"received {_describe(recvs)}; expected one message of {data.nbytes} bytes from rank {partner}"
    return None


def check_exchange(fn: Callable[[Any, np.ndarray], np.ndarray], timeout: float = 10.0) -> None:
    """Pairs (0,1), (2,3), ... swap arrays of 512 KiB without deadlock; a last odd rank keeps its own."""
    comm = MPI.COMM_WORLD
    sizes = list(range(1, comm.Get_size() + 1))
    each_size(comm, lambda sub: _exchange_problem(sub, fn, timeout), "exchange", sizes)
    passed(comm, "exchange swaps arrays between rank pairs without deadlock, one message each way")


# Exercise: ping_pong -----------------------------------------------------------
PLAUSIBLE = 10.0  # the student's time may differ from the reference's by this factor


def _ping_pong_traffic_problem(traffic: list[Traffic], nbytes: int, repeats: int) -> str | None:
    """What is wrong with the messages of a ping-pong (the same answer on every rank)."""
    for t in traffic[2:]:
        if t.events:
            return (
                f"rank {t.rank} sent {_describe(t.sends)} and received {_describe(t.recvs)}: "
                "only ranks 0 and 1 take part in a ping-pong"
            )
    for t in traffic[:2]:
        stray = [e for e in t.events if e.peer != 1 - t.rank]
        if stray:
            return f"rank {t.rank} exchanged {_describe(stray)}; it should only talk to rank {1 - t.rank}"
    total = sum(t.messages_sent for t in traffic)
    if total != 2 * repeats:
        return (
            f"{total} messages were sent in all, expected 2 * repeats = {2 * repeats} "
            f"({repeats} round trips: rank 0 to rank 1 and back)"
        )
    for t in traffic[:2]:
        if t.messages_sent != repeats or t.messages_received != repeats:
            return f"rank {t.rank} sent {t.messages_sent} and received {t.messages_received} messages, expected {repeats} each"
        wrong = [e for e in t.events if e.nbytes != nbytes]
        if wrong:
            return f"rank {t.rank} had {_describe(wrong)}; expected buf.nbytes = {nbytes} bytes each ({BUFFER_HINT})"
    return None


def _seconds_problem(rank: int, result: Any) -> str | None:
    if rank > 1:
        return None if result is None else f"returned {result!r}: ranks other than 0 and 1 return None"
    if isinstance(result, bool) or not isinstance(result, (float, int, np.floating, np.integer)):
        return f"returned {type(result).__name__}, expected the one-way time in seconds (a float)"
    if not math.isfinite(result) or result <= 0:
        return f"returned {result!r}, expected a positive one-way time in seconds"
    return None


def _timed(sub: MPI.Comm, fn: Callable, buf: np.ndarray, repeats: int, timeout: float) -> tuple[Any, float]:
    """fn(counting communicator, buf, repeats) under the check's timeout, and the seconds the call took."""

    def timed_call(comm: Comm, buf: np.ndarray, repeats: int) -> tuple[Any, float]:
        start = time.perf_counter()
        result = fn(comm, buf, repeats)
        return result, time.perf_counter() - start

    (result, elapsed), _ = run_counted(
        sub, timed_call, (buf, repeats), f"ping_pong timed on {sub.Get_size()} ranks", timeout
    )
    return result, elapsed


def _one_way_problem(result: float, elapsed: float, repeats: int) -> str | None:
    """The returned time against the call's own duration: 2 * repeats one-way messages fit inside it."""
    share = result * 2 * repeats / elapsed
    if share > 1.1:
        return (
            f"returned {result:.3g} s, but the whole call took {elapsed:.3g} s for 2 * repeats = {2 * repeats} "
            f"one-way messages, so one way takes at most {elapsed / (2 * repeats):.3g} s: return the one-way "
            "time (a round trip is two messages)"
        )
    if share < 0.5:
        return (
            f"returned {result:.3g} s, but {2 * repeats} one-way messages at that time make only "
            f"{100 * share:.0f}% of the {elapsed:.3g} s the call took: time all the repeats and divide "
            "by the number of one-way messages, 2 * repeats"
        )
    return None


def _plausibility_problem(sub: MPI.Comm, fn: Callable, timeout: float) -> str | None:
    """The student's time against the reference's (units), then the call's own duration (one way), 1 MiB buffer.

    Both run through the counting communicator, so both pay its cost and neither can hang.
    """
    buf, repeats = np.ones(2**17), 32
    got, want = [], []
    for _ in range(2):  # alternate, so both see the same load on the machine
        want.append(_timed(sub, p2p.ping_pong, buf, repeats, timeout)[0])
        got.append(_timed(sub, fn, buf, repeats, timeout))
    if sub.Get_rank() > 1:
        return None
    problem = next(filter(None, (_seconds_problem(sub.Get_rank(), g) for g, _ in got)), None)
    if problem:
        return problem
    mine, reference = min(g for g, _ in got), min(want)
    if not reference / PLAUSIBLE <= mine <= reference * PLAUSIBLE:
        return (
            f"returned {mine:.3g} s for a 1 MiB buffer and {repeats} repeats, but a reference ping-pong "
            f"takes {reference:.3g} s per one-way message here: return seconds (not ms), "
            "and divide the elapsed time by the number of one-way messages, 2 * repeats"
        )
    return next(filter(None, (_one_way_problem(g, t, repeats) for g, t in got)), None)


def _ping_pong_problem(sub: MPI.Comm, fn: Callable, timeout: float, timing: bool) -> str | None:
    size = sub.Get_size()
    for nbytes, repeats in ((8, 20), (2**20, 3)):
        buf = np.ones(nbytes // 8)
        result, traffic = run_counted(sub, fn, (buf, repeats), f"ping_pong on {count(size, 'rank')}", timeout)
        problem = _ping_pong_traffic_problem(traffic, buf.nbytes, repeats)
        if problem:
            raise CheckFailed(
                f"ping_pong on {count(size, 'rank')}, buf of {nbytes} bytes, repeats={repeats}: {problem}"
            )
        problem = _seconds_problem(sub.Get_rank(), result)
        if any(sub.allgather(problem)):  # agree before timing: it takes every rank
            return problem
    return _plausibility_problem(sub, fn, timeout) if timing else None


def check_ping_pong(fn: Callable[[Any, np.ndarray, int], float | None], timeout: float = 10.0) -> None:
    """2 * repeats messages of buf.nbytes, only between ranks 0 and 1; a plausible one-way time."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        raise CheckFailed("a ping-pong needs two ranks: start the cluster with at least 2 engines")
    sizes = sorted({2, comm.Get_size()})
    timed = sizes[-1]
    each_size(comm, lambda sub: _ping_pong_problem(sub, fn, timeout, sub.Get_size() == timed), "ping_pong", sizes)
    passed(comm, "ping_pong bounces 2 * repeats messages between ranks 0 and 1 and times one way")


# Exercise: fit_alpha_beta (no MPI) -------------------------------------------------
TRUE_ALPHA, TRUE_BETA = 2e-6, 1 / 5e9  # 2 microseconds, 5 GB/s


def _synthetic(noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sizes 8 B .. 64 MiB and times alpha + beta*n with relative noise."""
    n = np.array(p2p.default_sizes(), dtype=float)
    t = (TRUE_ALPHA + TRUE_BETA * n) * (1 + noise * np.random.default_rng(seed).standard_normal(n.size))
    return n, t


def _fit_problem(fn: Callable, n: np.ndarray, t: np.ndarray, what: str) -> str | None:
    want = p2p.fit_alpha_beta(n, t)
    got = fn(n.copy(), t.copy())
    try:
        alpha, beta = (float(v) for v in got)
    except (TypeError, ValueError):
        return f"on {what}: returned {got!r}, expected a tuple (alpha, beta) of two numbers"
    if not np.allclose([alpha, beta], want, rtol=1e-4, atol=0):
        return (
            f"on {what}: got alpha = {alpha:.4g} s, beta = {beta:.4g} s/byte; the least-squares fit of "
            f"relative errors, min sum(((alpha + beta*n - t) / t)**2), gives alpha = {want[0]:.4g} s, "
            f"beta = {want[1]:.4g} s/byte. Use every point, and divide each equation "
            "alpha + beta*n_i = t_i by t_i before solving (np.linalg.lstsq)"
        )
    return None


def check_fit_alpha_beta(fn: Callable[[np.ndarray, np.ndarray], tuple[float, float]]) -> None:
    """Runs in the notebook (no MPI): synthetic times with noise, with an outlier, and two points."""
    n, t = _synthetic(noise=0.05, seed=1)
    outlier = t.copy()
    outlier[n.size // 2] *= 5
    cases = [
        (n, t, f"synthetic data (alpha = {TRUE_ALPHA:g} s, beta = {TRUE_BETA:g} s/byte, 5% noise)"),
        (n, outlier, "the same data with one point in the middle five times too slow"),
        (n[[0, -1]], t[[0, -1]], "two points only (the line through both)"),
    ]
    for sizes, times, what in cases:
        problem = _fit_problem(fn, sizes, times, what)
        if problem:
            raise CheckFailed(f"fit_alpha_beta {problem}")
    print("passed: fit_alpha_beta finds the least-squares alpha and beta")

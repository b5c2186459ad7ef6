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
from ._draw import Draw, grading_draw, named

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


def _collect_lengths(size: int, draw: Draw | None) -> list[int]:
    """Every rank's length: (7r + 5) % 13 (0 for some), or under the grader's draw any from 0 to 2000."""
    if draw is None:
        return [(7 * rank + 5) % 13 for rank in range(size)]
    return [draw.integer(0, 2000, "collect", size, rank) for rank in range(size)]


def _collect_data(rank: int, lengths: list[int]) -> np.ndarray:
    """Rank r's float64 array: its own length, values r*100 + 0, 1, 2, ..."""
    return np.arange(lengths[rank], dtype=np.float64) + 100.0 * rank


def _collect_problem(sub: MPI.Comm, fn: Callable, timeout: float, draw: Draw | None = None) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    lengths = _collect_lengths(size, draw)
    data = _collect_data(rank, lengths)
    try:
        # Arrays arrive in reverse rank order: a list in arrival order is wrong on every run.
        got, traffic = run_counted(
            sub,
            fn,
            (data,),
            f"collect on {count(size, 'rank')}, lengths {lengths}{named(draw)}",
            timeout,
            stagger=STAGGER,
        )
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
        problem = array_problem(got[source], _collect_data(source, lengths), f"item {source} (rank {source}'s array)")
        if problem and any(array_problem(got[source], _collect_data(r, lengths), "") is None for r in range(size)):
            return (
                f"{problem}: it is another rank's array. Messages may arrive in any order (here: the "
                "highest rank's first); put each at its sender's index (status.Get_source())"
            )
        if problem:
            return problem
    if got[0].size and np.shares_memory(got[0], data):
        return "item 0 is rank 0's data itself: return a copy of it (data.copy()), a new array like the others"
    recvs = traffic[0].recvs
    expected = {source: _collect_data(source, lengths).nbytes for source in range(1, size)}
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
    draw = grading_draw(comm, "collect")

    def body(sub: MPI.Comm) -> str | None:
        problem = _collect_problem(sub, fn, timeout, draw)
        return (
            problem
            if problem is None or draw is None
            else f"{problem} (lengths {_collect_lengths(sub.Get_size(), draw)})"
        )

    each_size(comm, body, "collect", sizes, draw=draw)
    passed(comm, f"collect receives every rank's array, whatever its length, on rank 0{named(draw)}")


# Exercise: exchange ------------------------------------------------------------
EXCHANGE_LENGTH = 2**16 + 3  # about 512 KiB of int64: above every MPI's eager limit
#: The grader's draw: a length from 2**14 (32 KiB of int16, still above the eager limits) to 2**17, a dtype of these.
EXCHANGE_DTYPES = (np.int64, np.int32, np.int16, np.float64, np.float32)


def _exchange_case(draw: Draw | None) -> tuple[int, type]:
    """(length, dtype) of the arrays: the notebook's, or the grader's draw."""
    if draw is None:
        return EXCHANGE_LENGTH, np.int64
    return draw.integer(2**14, 2**17, "length"), draw.choose(EXCHANGE_DTYPES, 1, "dtype")[0]


def _exchange_data(rank: int, case: tuple[int, type] = (EXCHANGE_LENGTH, np.int64)) -> np.ndarray:
    """Rank r's array: 10**6 * (r + 1) + 0, 1, 2, ..., so its owner can be read off (wrapped in int16).

    Integers, not float64, so that a receive buffer made with NumPy's default dtype fails.
    """
    length, dtype = case
    return (np.arange(length, dtype=np.int64) + 10**6 * (rank + 1)).astype(dtype)


def _owner(got: np.ndarray, size: int, case: tuple[int, type]) -> int | None:
    """Which rank's array got is, if any."""
    for rank in range(size):
        if got.shape == (case[0],) and np.array_equal(got, _exchange_data(rank, case)):
            return rank
    return None


def _exchange_problem(sub: MPI.Comm, fn: Callable, timeout: float, draw: Draw | None = None) -> str | None:
    rank, size = sub.Get_rank(), sub.Get_size()
    partner = rank ^ 1 if rank ^ 1 < size else None
    case = _exchange_case(draw)
    data = _exchange_data(rank, case)
    context = f"exchange on {count(size, 'rank')}"
    if draw is not None:
        context += f", arrays of {case[0]} {np.dtype(case[1]).name} ({draw})"
    try:
        got, traffic = run_counted(sub, fn, (data,), context, timeout)
    except CheckFailed as err:
        if "Stalled" in str(err) or "PeerFailed" in str(err):
            raise CheckFailed(f"{err}\n{DEADLOCK_HINT}") from None
        raise
    if not np.array_equal(data, _exchange_data(rank, case)):
        return "exchange changed its input array: receive into a new array (np.empty_like(data)) instead"
    want = _exchange_data(rank if partner is None else partner, case)
    whose = (
        "its own array (no partner: the last of an odd number of ranks)"
        if partner is None
        else f"rank {partner}'s array"
    )
    problem = array_problem(got, want, f"the result (expected {whose})")
    if problem:
        owner = _owner(got, size, case) if isinstance(got, np.ndarray) else None
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
    draw = grading_draw(comm, "exchange")
    length, dtype = _exchange_case(draw)
    context = "exchange" if draw is None else f"exchange of arrays of {length} {np.dtype(dtype).name}"
    each_size(comm, lambda sub: _exchange_problem(sub, fn, timeout, draw), context, sizes, draw=draw)
    passed(comm, f"exchange swaps arrays between rank pairs without deadlock, one message each way{named(draw)}")


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


def _ping_pong_cases(draw: Draw | None) -> tuple[tuple[int, int], ...]:
    """(bytes, repeats) of the counted runs: a small buffer and a large one, the notebook's or the grader's."""
    if draw is None:
        return ((8, 20), (2**20, 3))
    return (
        (8 * draw.integer(1, 512, "small"), draw.integer(5, 30, "small")),
        (8 * draw.integer(2**15, 2**18, "large"), draw.integer(2, 4, "large")),
    )


def _ping_pong_problem(
    sub: MPI.Comm, fn: Callable, timeout: float, timing: bool, draw: Draw | None = None
) -> str | None:
    size = sub.Get_size()
    for nbytes, repeats in _ping_pong_cases(draw):
        buf = np.ones(nbytes // 8)
        result, traffic = run_counted(sub, fn, (buf, repeats), f"ping_pong on {count(size, 'rank')}", timeout)
        problem = _ping_pong_traffic_problem(traffic, buf.nbytes, repeats)
        if problem:
            raise CheckFailed(
                f"ping_pong on {count(size, 'rank')}, buf of {nbytes} bytes, repeats={repeats}{named(draw)}: {problem}"
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
    draw = grading_draw(comm, "ping_pong")
    each_size(
        comm,
        lambda sub: _ping_pong_problem(sub, fn, timeout, sub.Get_size() == timed, draw),
        "ping_pong",
        sizes,
        draw=draw,
    )
    passed(comm, f"ping_pong bounces 2 * repeats messages between ranks 0 and 1 and times one way{named(draw)}")


# Exercise: fit_alpha_beta (no MPI) -------------------------------------------------
TRUE_ALPHA, TRUE_BETA = 2e-6, 1 / 5e9  # 2 microseconds, 5 GB/s


def _synthetic(
    noise: float, seed: int, alpha: float = TRUE_ALPHA, beta: float = TRUE_BETA
) -> tuple[np.ndarray, np.ndarray]:
    """Sizes 8 B .. 64 MiB and times alpha + beta*n with relative noise."""
    n = np.array(p2p.default_sizes(), dtype=float)
    t = (alpha + beta * n) * (1 + noise * np.random.default_rng(seed).standard_normal(n.size))
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
    """Runs in the notebook (no MPI): synthetic times with noise, with an outlier, and two points.

    The grader's draw: alpha from 0.5 to 20 microseconds, a bandwidth from 1 to 25 GB/s, the noise,
    the slow point and the two points."""
    draw = grading_draw(None, "fit_alpha_beta")
    alpha, beta, seed, slow, pair = TRUE_ALPHA, TRUE_BETA, 1, None, [0, -1]
    if draw is not None:
        alpha, beta = draw.integer(5, 200, "alpha") * 1e-7, 1 / (draw.integer(1, 25, "bandwidth") * 1e9)
        last = len(p2p.default_sizes()) - 1
        seed, slow, pair = (
            draw.data_seed("noise"),
            draw.integer(1, last - 1, "slow"),
            draw.lengths(2, 0, last, "pair"),
        )
    n, t = _synthetic(noise=0.05, seed=seed, alpha=alpha, beta=beta)
    outlier = t.copy()
    where = "one point in the middle" if slow is None else f"point {slow}"
    slow = n.size // 2 if slow is None else slow
    outlier[slow] *= 5
    cases = [
        (n, t, f"synthetic data (alpha = {alpha:g} s, beta = {beta:g} s/byte, 5% noise, seed {seed}){named(draw)}"),
        (n, outlier, f"the same data with {where} five times too slow{named(draw)}"),
        (
            n[list(pair)],
            t[list(pair)],
            f"two points only{'' if draw is None else f', {pair[0]} and {pair[1]}'} (the line through both){named(draw)}",
        ),
    ]
    for sizes, times, what in cases:
        problem = _fit_problem(fn, sizes, times, what)
        if problem:
            raise CheckFailed(f"fit_alpha_beta {problem}")
    print("passed: fit_alpha_beta finds the least-squares alpha and beta")

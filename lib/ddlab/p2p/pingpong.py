"""Point-to-point messages: lab 01's reference exchange, collect, ping-pong, sweep and fit.

Hockney's model says sending n bytes takes T(n) = alpha + beta * n: a start-up
latency alpha plus n times the inverse bandwidth beta (R. W. Hockney, "The
communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel
Computing 20(3), 1994). Later labs price their algorithms with the alpha and
beta measured here.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
from mpi4py import MPI

from ..runtime.reference import reference

#: Ping-pong buffers from 8 bytes to 64 MiB, doubling.
SMALLEST, LARGEST = 8, 64 * 2**20


@reference("collect")
def collect(comm: MPI.Comm, data: np.ndarray) -> list[np.ndarray] | None:
    """Rank 0 receives every other rank's 1-D float64 array, of any length, in arrival order.

    Probe and its Status tell rank 0 who sent the next message and how long it is,
    before it allocates the buffer. Returns [rank 0's copy, rank 1's array, ...] on
    rank 0 and None elsewhere.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank != 0:
        comm.Send(np.ascontiguousarray(data, dtype=np.float64), dest=0)
        return None
    arrays: list[np.ndarray] = [np.array(data, dtype=np.float64)] + [np.empty(0)] * (size - 1)
    status = MPI.Status()
    for _ in range(size - 1):
        comm.Probe(source=MPI.ANY_SOURCE, status=status)
        source = status.Get_source()
        arrays[source] = np.empty(status.Get_count(MPI.DOUBLE))
        comm.Recv(arrays[source], source=source)
    return arrays


@reference("exchange")
def exchange(comm: MPI.Comm, data: np.ndarray) -> np.ndarray:
    """Swap data with partner rank ^ 1 and return the partner's array (a new one).

    Sendrecv cannot deadlock, whatever the size. With an odd number of ranks the
    last one has no partner and returns a copy of its own data. Every rank passes
    an array of the same shape and dtype; data is not modified.
    """
    partner = comm.Get_rank() ^ 1
    if partner >= comm.Get_size():
        return data.copy()
    received = np.empty_like(data)
    comm.Sendrecv(data, dest=partner, recvbuf=received, source=partner)
    return received


@reference("ping_pong")
def ping_pong(comm: MPI.Comm, buf: np.ndarray, repeats: int) -> float | None:
    """Bounce buf between ranks 0 and 1 `repeats` times; the mean one-way time in seconds.

    Rank 0 sends, rank 1 receives into buf and sends it back: 2 * repeats
    messages of buf.nbytes. Ranks 0 and 1 return their measured time; other
    ranks take no part and return None. buf is overwritten on rank 1.
    """
    if comm.Get_size() < 2:
        raise ValueError("ping_pong needs at least two ranks: run it on a communicator of 2 or more")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    rank = comm.Get_rank()
    if rank > 1:
        return None
    start = time.perf_counter()
    for _ in range(repeats):
        if rank == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        else:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
    return (time.perf_counter() - start) / (2 * repeats)


def default_sizes() -> list[int]:
    """Message sizes for a sweep: powers of two from 8 B to 64 MiB."""
    return [2**k for k in range(SMALLEST.bit_length() - 1, LARGEST.bit_length())]


def default_repeats(nbytes: int) -> int:
    """Round trips per timing: many for small messages (noisy), few for large ones (slow)."""
    return int(np.clip(2**22 // max(nbytes, 1), 3, 50))


def idle_wait(request: MPI.Request, interval: float = 1e-3) -> None:
    """Wait for request while sleeping between tests.

    A rank blocked in MPI spins on a core; with more ranks than cores, idle ranks
    spinning would slow down the two that measure.
    """
    while not request.Test():
        time.sleep(interval)


def sweep(comm: MPI.Comm, sizes: Sequence[int], repeats: int | None = None, trials: int = 3) -> np.ndarray:
    """One-way ping-pong time in seconds for each size, between ranks 0 and 1.

    A collective call: every rank of comm calls it and gets rank 0's measurements.
    Each size gets one untimed round trip first (connection set-up, page faults),
    then `trials` timings of `repeats` round trips (default: `default_repeats(size)`),
    of which the fastest counts: other programs on the machine only ever add time.
    """
    sizes = [int(n) for n in sizes]
    if any(n < 0 for n in sizes):
        raise ValueError(f"message sizes must be non-negative byte counts, got {sizes}")
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    times = np.zeros(len(sizes))
    if comm.Get_rank() < 2:
        for i, nbytes in enumerate(sizes):
            buf = np.ones(nbytes, dtype=np.uint8)
            ping_pong(comm, buf, 1)
            count = default_repeats(nbytes) if repeats is None else repeats
            times[i] = min(float(ping_pong(comm, buf, count) or 0.0) for _ in range(trials))
    idle_wait(comm.Ibcast(times, root=0))
    return times


@reference("fit_alpha_beta")
def fit_alpha_beta(nbytes: Sequence[float] | np.ndarray, seconds: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Fit T(n) = alpha + beta * n by least squares on relative errors; return (alpha, beta).

    Minimises sum(((alpha + beta * n_i - t_i) / t_i) ** 2): each measurement counts
    for its relative error, so the microsecond times of small messages shape alpha
    as much as the millisecond times of large ones shape beta.
    """
    n = np.asarray(nbytes, dtype=float).ravel()
    t = np.asarray(seconds, dtype=float).ravel()
    if n.shape != t.shape:
        raise ValueError(f"need one time per size: got {n.size} sizes and {t.size} times")
    if not (np.all(np.isfinite(n)) and np.all(np.isfinite(t))):
        raise ValueError("sizes and times must be finite numbers (no NaN or inf)")
    if np.any(n < 0) or np.any(t <= 0):
        raise ValueError("sizes must be >= 0 bytes and times > 0 seconds")
    if np.unique(n).size < 2:
        raise ValueError("need measurements at two or more different sizes to fit a line")
    rows = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)

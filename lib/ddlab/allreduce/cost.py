"""The one cost model of links and collectives: what a message and every collective should cost.

A link is Hockney's model (R. W. Hockney, "The communication challenge for MPP: Intel
Paragon and Meiko CS-2", Parallel Computing 20(3), 1994) with the adds of a reduction:

    T = alpha * messages + beta * bytes sent + gamma * bytes reduced

with alpha the start-up time of a message, beta the time per byte moved and gamma the
time per byte added. A collective is priced by what lies on its critical path (`Terms`:
messages, bytes sent, bytes reduced), one formula per collective and algorithm:

- allreduce (`terms`): the formulas of Thakur, Rabenseifner & Gropp, "Optimization of
  collective communication operations in MPICH" (IJHPCA 19(1), 2005), the ring's those of
  Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations"
  (JPDC 69(2), 2009), and the lower bound that of Chan, Heimlich, Purkayastha & van de
  Geijn, "Collective communication: theory, practice, and experience" (CCPE 19(13), 2007);
- reduce-scatter, allgather, broadcast, all-to-all and a point-to-point message
  (`collective_terms`), after the same papers: n is the bytes of the whole vector (the
  input of a reduce-scatter, the result of an allgather, all a rank sends in an all-to-all).

Lab 03 fits alpha and beta with lab 01's ping-pong and gamma by timing a NumPy add
(`fit_link`); lab 09's oracle prices with it where it has no measured curve, lab 10 and 11's
models call it for the ring, the sparse allgather and the hierarchical allreduce.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import numpy.typing as npt
from mpi4py import MPI

#: Where MPICH switches from recursive doubling to Rabenseifner's algorithm
#: (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE, in bytes).
MPICH_SHORT_MSG_SIZE = 2048

#: The allreduce algorithms lab 03 introduces, in its order (`terms` knows them all).
MODELS = ("naive", "tree", "recursive_doubling", "ring", "rabenseifner", "lower_bound")

#: Every allreduce formula: lab 03's and the idealised bandwidth-optimal one the oracle assumes for
#: large messages, reduce-scatter by recursive halving then allgather by recursive doubling with
#: ceil(log2 P) steps each and no fold for P not a power of two.
ALLREDUCE_ALGORITHMS = (*MODELS, "halving_doubling")

#: The collectives `collective_terms` prices, each with its algorithms; the first is the default,
#: the bandwidth-optimal one MPI libraries use for large messages.
COLLECTIVES: dict[str, tuple[str, ...]] = {
    "allreduce": ("halving_doubling", *MODELS),
    "reduce_scatter": ("halving", "ring"),
    "allgather": ("doubling", "ring"),
    "broadcast": ("tree", "linear"),
    "alltoall": ("pairwise",),
    "p2p": ("message",),
}


@dataclass(frozen=True)
class Link:
    """Hockney's model of a link: seconds per message (alpha), per byte sent (beta), per byte reduced (gamma)."""

    alpha: float
    beta: float
    gamma: float = 0.0

    def seconds(self, nbytes: float | np.ndarray) -> float | np.ndarray:
        """One message of `nbytes` bytes: alpha + n beta."""
        return self.alpha + self.beta * np.asarray(nbytes, dtype=float)


@dataclass(frozen=True)
class Terms:
    """A critical path: messages, bytes sent, bytes reduced (numbers or arrays); terms add up."""

    messages: float | np.ndarray
    bytes: float | np.ndarray
    reduced: float | np.ndarray

    def seconds(self, link: Link) -> float | np.ndarray:
        """The predicted time over `link`."""
        return link.alpha * self.messages + link.beta * self.bytes + link.gamma * self.reduced

    def __add__(self, other: Terms) -> Terms:
        return Terms(self.messages + other.messages, self.bytes + other.bytes, self.reduced + other.reduced)


def terms(algorithm: str, size: int, nbytes: float | np.ndarray) -> Terms:
    """The critical path of allreduce of `nbytes` bytes on `size` ranks (`ALLREDUCE_ALGORITHMS` names it).

    For recursive doubling and Rabenseifner with P not a power of two, p' is the largest
    power of two below P and the fold in and out adds 2 messages of n bytes and one add.
    """
    if size < 1:
        raise ValueError(f"need at least one rank, got size={size}")
    n = np.asarray(nbytes, dtype=float)
    p, pof2 = size, 1 << (size.bit_length() - 1)
    steps, log_p = math.log2(pof2), math.ceil(math.log2(p))
    fold = float(p != pof2)
    share, pof2_share = (p - 1) / p, (pof2 - 1) / pof2
    if algorithm == "halving_doubling":
        return collective_terms("reduce_scatter", size, n, "halving") + collective_terms(
            "allgather", size, n, "doubling"
        )
    formulas: dict[str, Callable[[], tuple[float, np.ndarray, np.ndarray]]] = {
        "naive": lambda: (2 * (p - 1), 2 * (p - 1) * n, (p - 1) * n),
        "tree": lambda: (2 * log_p, 2 * log_p * n, log_p * n),
        "recursive_doubling": lambda: (steps + 2 * fold, (steps + 2 * fold) * n, (steps + fold) * n),
        "ring": lambda: (2 * (p - 1), 2 * share * n, share * n),
        "rabenseifner": lambda: (2 * steps + 2 * fold, (2 * pof2_share + 2 * fold) * n, (pof2_share + fold) * n),
        "lower_bound": lambda: (log_p, 2 * share * n, share * n),
    }
    if algorithm not in formulas:
        raise ValueError(f"no cost model named {algorithm!r}: choose one of {', '.join(ALLREDUCE_ALGORITHMS)}")
    messages, sent, reduced = formulas[algorithm]()
    return Terms(float(messages), sent, reduced)


def collective_terms(op: str, size: int, nbytes: float | np.ndarray, algorithm: str | None = None) -> Terms:
    """The critical path of collective `op` (a key of `COLLECTIVES`) of `nbytes` bytes on `size` ranks.

    n is the whole vector: the input of a reduce-scatter, the result of an allgather, what
    the root sends in a broadcast, all one rank sends in an all-to-all (1/P of it to each
    rank, its own part staying). With L = ceil(log2 P):

        reduce_scatter  halving   L messages,     (P-1)/P n bytes, (P-1)/P n reduced
                        ring      P-1 messages,   (P-1)/P n bytes, (P-1)/P n reduced
        allgather       doubling  L messages,     (P-1)/P n bytes
                        ring      P-1 messages,   (P-1)/P n bytes
        broadcast       tree      L messages,     L n bytes
                        linear    P-1 messages,   (P-1) n bytes
        alltoall        pairwise  P-1 messages,   (P-1)/P n bytes
        p2p             message   1 message,      n bytes            (size is ignored)
    """
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(COLLECTIVES)}")
    algorithm = algorithm or COLLECTIVES[op][0]
    if algorithm not in COLLECTIVES[op]:
        raise ValueError(f"no {op} algorithm named {algorithm!r}: choose one of {', '.join(COLLECTIVES[op])}")
    if size < 1:
        raise ValueError(f"need at least one rank, got size={size}")
    n = np.asarray(nbytes, dtype=float)
    if op == "p2p":
        return Terms(1.0, n, 0.0 * n)
    if op == "allreduce":
        return terms(algorithm, size, n)
    p, log_p = size, math.ceil(math.log2(size))
    part = (p - 1) * n / p
    messages = {"halving": log_p, "doubling": log_p, "tree": log_p, "ring": p - 1, "linear": p - 1, "pairwise": p - 1}
    sent = {"tree": log_p * n, "linear": (p - 1) * n}.get(algorithm, part)
    return Terms(float(messages[algorithm]), sent, part if op == "reduce_scatter" else 0.0 * n)


def collective_seconds(
    op: str, size: int, nbytes: float | np.ndarray, link: Link, algorithm: str | None = None
) -> float | np.ndarray:
    """Predicted seconds of collective `op` of `nbytes` bytes on `size` ranks over `link` (see `collective_terms`)."""
    return collective_terms(op, size, nbytes, algorithm).seconds(link)


def predict(algorithm: str, size: int, nbytes: float | np.ndarray, link: Link) -> float | np.ndarray:
    """Predicted seconds of one allreduce of `nbytes` bytes on `size` ranks."""
    return terms(algorithm, size, nbytes).seconds(link)


def crossover(first: str, second: str, size: int, link: Link) -> float | None:
    """The message size in bytes above which `second` beats `first`, or None if it never does.

    Each model is a line in n, T = a + b n, so they cross once at most.
    """
    a1, a2 = predict(first, size, 0.0, link), predict(second, size, 0.0, link)
    b1, b2 = predict(first, size, 1.0, link) - a1, predict(second, size, 1.0, link) - a2
    if b1 <= b2 or a2 <= a1:  # second is never cheaper per byte, or is cheaper from the start
        return None if b1 <= b2 else 0.0
    return float((a2 - a1) / (b1 - b2))


def bus_bandwidth(nbytes: float | np.ndarray, seconds: float | np.ndarray, size: int) -> float | np.ndarray:
    """Bytes per second each rank's link carries: n/T * 2(P-1)/P (NCCL's "bus bandwidth").

    An allreduce must move at least 2(P-1)/P n bytes in and out of every rank, so
    bus bandwidth compares with the hardware's bandwidth whatever the rank count
    (NVIDIA, nccl-tests, doc/PERFORMANCE.md).
    """
    return np.asarray(nbytes, dtype=float) / np.asarray(seconds, dtype=float) * 2 * (size - 1) / size


def _best_seconds(action: Callable[[], object], repeats: int) -> float:
    action()  # the first run touches fresh pages: not counted
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best


def measure_gamma(nbytes: int = 8 * 2**20, dtype: npt.DTypeLike = np.float32, repeats: int = 5) -> float:
    """Seconds per byte of np.add(a, b, out=a) on vectors of `nbytes` bytes, best of `repeats`."""
    a = np.ones(nbytes // np.dtype(dtype).itemsize, dtype=dtype)
    b = np.ones_like(a)
    return _best_seconds(lambda: np.add(a, b, out=a), repeats) / a.nbytes


def measure_memcpy_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes per second np.copyto copies between two buffers of `nbytes` bytes, best of `repeats`."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return nbytes / _best_seconds(lambda: np.copyto(dst, src), repeats)


def fit_link(comm: MPI.Comm, sizes: Sequence[int] | None = None, repeats: int | None = None) -> Link:
    """Alpha and beta from lab 01's ping-pong between ranks 0 and 1, gamma from a NumPy add.

    A collective call; every rank gets the same Link. Gamma is timed on every rank
    at once, as the adds of an allreduce run, and the slowest rank's value is kept.
    """
    from ..p2p import default_sizes, fit_alpha_beta, sweep

    sizes = list(sizes or default_sizes())
    alpha, beta = fit_alpha_beta(sizes, sweep(comm, sizes, repeats))
    comm.Barrier()
    gamma = comm.allreduce(measure_gamma(), op=MPI.MAX)
    return Link(alpha, beta, gamma)


def time_allreduce(
    comm: MPI.Comm,
    algorithms: dict[str, Callable],
    sizes: Sequence[int],
    repeats: int = 3,
    dtype: npt.DTypeLike = np.float32,
) -> dict[str, np.ndarray]:
    """Seconds of each call, per algorithm: an array of shape (len(sizes), repeats).

    A collective call; every rank gets the same numbers. Each call counts as its slowest
    rank's time, ranks starting together after a barrier. The algorithms take turns
    within every repeat, so load from elsewhere on the machine hits them all alike.
    Sizes are in bytes; each algorithm runs once untimed first (page faults, connections).
    """
    seconds = {name: np.zeros((len(sizes), repeats)) for name in algorithms}
    for i, nbytes in enumerate(sizes):
        x = np.ones(int(nbytes) // np.dtype(dtype).itemsize, dtype=dtype)
        for fn in algorithms.values():
            fn(comm, x)
        for j in range(repeats):
            for name, fn in algorithms.items():
                comm.Barrier()
                start = MPI.Wtime()
                fn(comm, x)
                seconds[name][i, j] = comm.allreduce(MPI.Wtime() - start, op=MPI.MAX)
    return seconds

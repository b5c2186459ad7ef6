"""What allreduce should cost, and the measurements to hold the predictions against.

The alpha-beta-gamma model prices a collective by what lies on its critical path:

    T = alpha * messages + beta * bytes sent + gamma * bytes reduced

with alpha the start-up time of a message, beta the time per byte moved and gamma
the time per byte added. The formulas are those of Thakur, Rabenseifner & Gropp,
"Optimization of collective communication operations in MPICH" (IJHPCA 19(1), 2005),
the ring's those of Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations" (JPDC 69(2), 2009), and the lower bound that of Chan,
Heimlich, Purkayastha & van de Geijn, "Collective communication: theory, practice,
and experience" (CCPE 19(13), 2007). Alpha and beta come from lab 01's ping-pong,
gamma from timing a NumPy add.
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

#: The names `terms` knows, in the order lab 03 introduces them.
MODELS = ("naive", "tree", "recursive_doubling", "ring", "rabenseifner", "lower_bound")


@dataclass(frozen=True)
class Machine:
    """The model's constants: seconds per message, per byte sent, per byte reduced."""

    alpha: float
    beta: float
    gamma: float


@dataclass(frozen=True)
class Terms:
    """An algorithm's critical path: messages, bytes sent, bytes reduced (numbers or arrays)."""

    messages: float | np.ndarray
    bytes: float | np.ndarray
    reduced: float | np.ndarray

    def seconds(self, machine: Machine) -> float | np.ndarray:
        """The predicted time on `machine`."""
        return machine.alpha * self.messages + machine.beta * self.bytes + machine.gamma * self.reduced


def terms(algorithm: str, size: int, nbytes: float | np.ndarray) -> Terms:
    """The critical path of allreduce of `nbytes` bytes on `size` ranks (`MODELS` names it).

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
    formulas: dict[str, Callable[[], tuple[float, np.ndarray, np.ndarray]]] = {
        "naive": lambda: (2 * (p - 1), 2 * (p - 1) * n, (p - 1) * n),
        "tree": lambda: (2 * log_p, 2 * log_p * n, log_p * n),
        "recursive_doubling": lambda: (steps + 2 * fold, (steps + 2 * fold) * n, (steps + fold) * n),
        "ring": lambda: (2 * (p - 1), 2 * share * n, share * n),
        "rabenseifner": lambda: (2 * steps + 2 * fold, (2 * pof2_share + 2 * fold) * n, (pof2_share + fold) * n),
        "lower_bound": lambda: (log_p, 2 * share * n, share * n),
    }
    if algorithm not in formulas:
        raise ValueError(f"no cost model named {algorithm!r}: choose one of {', '.join(MODELS)}")
    messages, sent, reduced = formulas[algorithm]()
    return Terms(float(messages), sent, reduced)


def predict(algorithm: str, size: int, nbytes: float | np.ndarray, machine: Machine) -> float | np.ndarray:
    """Predicted seconds of one allreduce of `nbytes` bytes on `size` ranks."""
    return terms(algorithm, size, nbytes).seconds(machine)


def crossover(first: str, second: str, size: int, machine: Machine) -> float | None:
    """The message size in bytes above which `second` beats `first`, or None if it never does.

    Each model is a line in n, T = a + b n, so they cross once at most.
    """
    a1, a2 = predict(first, size, 0.0, machine), predict(second, size, 0.0, machine)
    b1, b2 = predict(first, size, 1.0, machine) - a1, predict(second, size, 1.0, machine) - a2
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


def fit_machine(comm: MPI.Comm, sizes: Sequence[int] | None = None, repeats: int | None = None) -> Machine:
    """Alpha and beta from lab 01's ping-pong between ranks 0 and 1, gamma from a NumPy add.

    A collective call; every rank gets the same Machine. Gamma is timed on every rank
    at once, as the adds of an allreduce run, and the slowest rank's value is kept.
    """
    from ..p2p import default_sizes, fit_alpha_beta, sweep

    sizes = list(sizes or default_sizes())
    alpha, beta = fit_alpha_beta(sizes, sweep(comm, sizes, repeats))
    comm.Barrier()
    gamma = comm.allreduce(measure_gamma(), op=MPI.MAX)
    return Machine(alpha, beta, gamma)


def time_allreduce(comm: MPI.Comm, algorithms: dict[str, Callable], sizes: Sequence[int],
                   repeats: int = 3, dtype: npt.DTypeLike = np.float32) -> dict[str, np.ndarray]:
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

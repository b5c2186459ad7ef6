"""A reduction in low precision: how its error grows with the number of ranks that add into it (lab 18).

A ring reduce-scatter adds P contributions one rank after another; if each partial sum is
rounded to a format of unit roundoff u (2^-8 for bfloat16, 2^-24 for float32), the sum carries
up to P - 1 roundings, and the inputs' cast one more: for every element

    |computed - exact| <= gamma_P * sum_i |x_i|,    gamma_P = P u / (1 - P u)

(Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 2002, section 4.2, the bound
of recursive summation, with the inputs' rounding added). The bound grows linearly with P:
bfloat16's u is 65536 times float32's, so a gradient summed in bfloat16 over 8 ranks can lose
about 3% of its size while float32 loses nothing visible. That is why recipes reduce gradients
in float32 (or sum scaled values), even when they compute in bfloat16.

Exercise 18.4's signature (`reduce_scatter_rounded` is the reference):

    reduce_scatter_rounded(comm, x, bounds, dtype) -> np.ndarray

lab 13's ring reduce-scatter with every
partial sum rounded to `dtype` (torch.bfloat16 or torch.float32) and sent in it. `x` a float32
1-D NumPy array, the same length on every rank; returns a new float32 array, rank r's chunk of
the sum (values representable in `dtype`); `x` unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ..runtime.comm import Comm
from ..runtime.reference import reference

#: Unit roundoff of each format: 2^-(significand bits, the implicit one included).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
#: NumPy carrier of each format's bits on the wire.
WIRE = {torch.float32: torch.float32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _round(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)


@reference("reduce_scatter_rounded")
def reduce_scatter_rounded(comm: Comm, x: np.ndarray, bounds: list[int], dtype: torch.dtype) -> np.ndarray:
    """The ring reduce-scatter, each partial sum rounded to `dtype` and sent as its bits."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no rounded reduction in {dtype}: use one of {sorted(map(str, UNIT_ROUNDOFF))}")
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    chunk = lambda c: x[bounds[c] : bounds[c + 1]]  # noqa: E731
    partial = _round(chunk((rank - 1) % size), dtype)
    for step in range(size - 1):
        incoming = (rank - step - 2) % size
        received = torch.empty(bounds[incoming + 1] - bounds[incoming], dtype=dtype)
        comm.Sendrecv(
            partial.view(WIRE[dtype]).numpy(), dest=right, recvbuf=received.view(WIRE[dtype]).numpy(), source=left
        )
        partial = (received.float() + _round(chunk(incoming), dtype).float()).to(dtype)
    return partial.float().numpy().copy()


def reduction_bound(x_abs_sum: np.ndarray, size: int, dtype: torch.dtype) -> np.ndarray:
    """Higham's bound on each element's error: gamma_P * sum_i |x_i| (see the module's docstring)."""
    pu = size * UNIT_ROUNDOFF[dtype]
    return pu / (1 - pu) * x_abs_sum


def relative_error(comm: Comm, x: np.ndarray, bounds: list[int], dtype: torch.dtype) -> tuple[float, float]:
    """(largest |error| / sum_i |x_i| over this rank's chunk, the bound's gamma_P) of the rounded reduce-scatter."""
    rank, size = comm.Get_rank(), comm.Get_size()
    got = reduce_scatter_rounded(comm, x, bounds, dtype)
    full = np.ascontiguousarray(x, dtype=np.float64)
    exact, magnitude = np.empty_like(full), np.empty_like(full)
    comm.Allreduce(full, exact, op=MPI.SUM)  # the exact sums, in float64, to compare with
    comm.Allreduce(np.abs(full), magnitude, op=MPI.SUM)
    mine = slice(bounds[rank], bounds[rank + 1])
    ratio = np.abs(got - exact[mine]) / np.where(magnitude[mine] > 0, magnitude[mine], 1.0)
    pu = size * UNIT_ROUNDOFF[dtype]
    return float(ratio.max(initial=0.0)), pu / (1 - pu)

"""Gradient buckets: fuse many small allreduces into a few large ones, in backward order.

An allreduce of n bytes costs about alpha + n*beta, so k separate tensors cost k*alpha
more than one fused buffer. One buffer for the whole model, though, can only start
once backward has produced the last gradient. Buckets of at most `cap` bytes are the
middle way (PyTorch DDP's default cap is 25 MB: Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020). Backward produces
gradients from the last layer to the first, so buckets are filled in reverse order
of the model's parameters, and the first bucket is ready early.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch
from mpi4py import MPI

from ..runtime.reference import reference

#: PyTorch DDP's default bucket cap, in MiB.
DEFAULT_CAP_MB = 25.0


class InFlight(Protocol):
    """An allreduce under way: MPI's request, or the future of a helper thread waiting on one."""

    def done(self) -> bool: ...

    def result(self) -> float: ...  # waits; the time it completed


class RequestInFlight:
    """An MPI request as InFlight; `now` reads the clock that times completions."""

    def __init__(self, request: MPI.Request, now: Callable[[], float]):
        self.request, self.now = request, now

    def done(self) -> bool:
        return self.request.Test()

    def result(self) -> float:
        self.request.Wait()
        return self.now()


@reference("overlapped_averaging")
@dataclass
class Bucket:
    """Parameters whose gradients travel in one allreduce, and the flat buffer they travel in.

    The buffer is also the gradients' storage: once a bucket has started, each
    parameter's `.grad` is a view of it, so later backward passes accumulate straight
    into it, and the averaged values need no copying back (as PyTorch DDP's
    gradient_as_bucket_view). A bucket keeps its own state through a step:
    `pending` gradients still to come, the allreduce `in_flight`, when it `started`.
    """

    index: int
    params: list[torch.nn.Parameter]
    buffer: np.ndarray = field(repr=False)
    offsets: list[int] = field(repr=False)
    tensor: torch.Tensor = field(init=False, repr=False)  # the buffer as a tensor (same memory)
    pending: int = field(init=False, repr=False)
    in_flight: InFlight | None = field(default=None, init=False, repr=False)
    started: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.tensor = torch.from_numpy(self.buffer)
        self.pending = len(self.params)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def view(self, i: int) -> torch.Tensor:
        """The part of the buffer holding parameter i's gradient, shaped like it."""
        p = self.params[i]
        return self.tensor[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    def gather_gradients(self) -> None:
        """Make every parameter's .grad a view of the buffer (copying in any gradient that is not one)."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                view = self.view(i)
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                else:
                    continue
                p.grad = view

    def start(self, in_flight: InFlight | None, now: float) -> None:
        """Note the allreduce of this bucket's buffer that was just started (None: it already ran)."""
        self.in_flight, self.started = in_flight, now

    def poll(self) -> float | None:
        """The time its allreduce completed, if it just did (once); else None."""
        if self.in_flight is None or not self.in_flight.done():
            return None
        return self.finish()

    def finish(self) -> float | None:
        """Wait for the allreduce in flight; the time it completed (None if none was in flight)."""
        in_flight, self.in_flight = self.in_flight, None
        return None if in_flight is None else in_flight.result()


def cap_bytes(cap_mb: float | None) -> float:
    """Bytes for a cap in MiB; None or inf mean no cap (one bucket per dtype), 0 one tensor per bucket."""
    if cap_mb is None or math.isinf(cap_mb):
        return math.inf
    if cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0 (0: one bucket per tensor; None: no cap), got {cap_mb}")
    return cap_mb * 2**20


def plan_buckets(
    params: list[torch.nn.Parameter], cap_mb: float | None = DEFAULT_CAP_MB
) -> list[list[torch.nn.Parameter]]:
    """Group parameters, last first, into runs of one dtype of at most cap bytes.

    A tensor larger than the cap gets a bucket of its own.
    """
    cap = cap_bytes(cap_mb)
    groups: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        fits = groups and groups[-1][0].dtype == p.dtype and size + nbytes <= cap
        if fits:
            groups[-1].append(p)
            size += nbytes
        else:
            groups.append([p])
            size = nbytes
    return groups


def make_buckets(params: list[torch.nn.Parameter], cap_mb: float | None = DEFAULT_CAP_MB) -> list[Bucket]:
    """Buckets with their flat buffers allocated."""
    buckets = []
    for index, group in enumerate(plan_buckets(params, cap_mb)):
        offsets = [0]
        for p in group[:-1]:
            offsets.append(offsets[-1] + p.numel())
        numel = offsets[-1] + group[-1].numel()
        dtype = torch.empty((), dtype=group[0].dtype).numpy().dtype
        buckets.append(Bucket(index, group, np.zeros(numel, dtype=dtype), offsets))
    return buckets

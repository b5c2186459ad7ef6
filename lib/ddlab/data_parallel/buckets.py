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

import numpy as np
import torch

#: PyTorch DDP's default bucket cap, in MiB.
DEFAULT_CAP_MB = 25.0


@dataclass
class Bucket:
    """Parameters whose gradients travel in one allreduce, and the flat buffer they travel in."""

    index: int
    params: list[torch.nn.Parameter]
    buffer: np.ndarray = field(repr=False)
    offsets: list[int] = field(repr=False)
    tensor: torch.Tensor = field(init=False, repr=False)  # the buffer as a tensor (same memory)

    def __post_init__(self) -> None:
        self.tensor = torch.from_numpy(self.buffer)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def view(self, i: int) -> torch.Tensor:
        """The part of the buffer holding parameter i's gradient, shaped like it."""
        p = self.params[i]
        return self.tensor[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


def cap_bytes(cap_mb: float | None) -> float:
    """Bytes for a cap in MiB; None or inf mean no cap (one bucket per dtype), 0 one tensor per bucket."""
    if cap_mb is None or math.isinf(cap_mb):
        return math.inf
    if cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0 (0: one bucket per tensor; None: no cap), got {cap_mb}")
    return cap_mb * 2**20


def plan_buckets(params: list[torch.nn.Parameter], cap_mb: float | None = DEFAULT_CAP_MB) -> list[list[torch.nn.Parameter]]:
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

"""Compressed allreduces for the data-parallel trainer: `allreduce(comm, x) -> sums`, with memory.

`CompressedAllreduce(method, density, feedback)` is a function of lab 03's signature
(plus state: the residual of error feedback and a tally of bytes), so lab 04's
`DataParallel(model, comm, allreduce=CompressedAllreduce("topk", 0.01))` trains with it.
Each rank compresses its gradient (plus its residual), all compressed messages are
gathered, and every rank adds up their decompressed vectors:

- "dense": lab 03's ring, the baseline (no compression, no residual).
- "topk", "randomk": `density` n pairs through `sparse_allreduce` (Allgatherv).
- "qsgd8": one byte per item (`quantize_8bit`), through Allgather.
- "sign": one bit per item (`sign_1bit`), through Allgather.

The residual is kept per vector length: use one instance per bucket when buckets of
equal length take turns (the default 25 MB bucket holds lab 04's whole MLP).
`bytes_sent` adds up, per call, the bytes a ring (all)gather makes each rank send on
average, (P-1) times a message for the gathers, 2(P-1)/P n items for the dense ring.
"""

from __future__ import annotations

import numpy as np

from ..allreduce import allreduce_ring
from ..allreduce.cost import terms
from ..runtime.comm import Comm
from .compressors import (
    ErrorFeedback,
    densify,
    dequantize_8bit,
    keep_count,
    quantize_8bit,
    random_k,
    sign_1bit,
    top_k,
    unsign_1bit,
)
from .sparse import allgather_bytes_per_rank, sparse_allreduce

METHODS = ("dense", "topk", "randomk", "qsgd8", "sign")


def _gather_dense(comm: Comm, payload: np.ndarray) -> list[np.ndarray]:
    """Every rank's byte payload (all of one length), through one Allgather."""
    table = np.empty((comm.Get_size(), payload.size), dtype=np.uint8)
    comm.Allgather(payload, table)
    return list(table)


class CompressedAllreduce:
    """allreduce(comm, x) that sends a compressed x (plus the residual, with feedback)."""

    def __init__(self, method: str, density: float = 0.01, feedback: bool = True, seed: int = 0):
        if method not in METHODS:
            raise ValueError(f"no method {method!r}: choose one of {', '.join(METHODS)}")
        keep_count(1, density)  # validates the density
        self.method, self.density, self.feedback, self.seed = method, density, feedback, seed
        self.memory: dict[int, ErrorFeedback] = {}
        self.bytes_sent = 0.0
        self.calls = 0

    def __repr__(self) -> str:
        return f"CompressedAllreduce({self.method!r}, density={self.density}, feedback={self.feedback})"

    def __call__(self, comm: Comm, x: np.ndarray) -> np.ndarray:
        size = comm.Get_size()
        self.calls += 1
        if self.method == "dense":
            self.bytes_sent += float(terms("ring", size, x.nbytes).bytes)
            return allreduce_ring(comm, x)
        memory = self.memory.setdefault(x.size, ErrorFeedback())
        fed = memory.feed(x) if self.feedback else np.array(x, copy=True)
        total, sent = self._exchange(comm, fed)
        if self.feedback:
            memory.keep(fed, sent)
        return total

    def _exchange(self, comm: Comm, fed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sum over ranks of what they sent, what this rank sent), both dense."""
        size, rng = comm.Get_size(), np.random.default_rng([self.seed, comm.Get_rank(), self.calls])
        if self.method in ("topk", "randomk"):
            k = keep_count(fed.size, self.density)
            message = top_k(fed, k) if self.method == "topk" else random_k(fed, k, rng)
            self.bytes_sent += float(allgather_bytes_per_rank(message.nbytes, size))
            return sparse_allreduce(comm, message.indices, message.values, fed.size), densify(message)
        if self.method == "qsgd8":
            quantized = quantize_8bit(fed, rng)
            payload = np.concatenate([quantized.scale.view(np.uint8), quantized.levels.view(np.uint8)])
            rows = _gather_dense(comm, payload)
            scale_bytes = quantized.scale.nbytes
            decode = [
                dequantize_8bit(type(quantized)(r[scale_bytes:].view(np.int8), r[:scale_bytes].view(fed.dtype)))
                for r in rows
            ]
            sent = dequantize_8bit(quantized)
        else:
            signs = sign_1bit(fed)
            payload = np.concatenate([signs.scale.view(np.uint8), signs.bits])
            rows = _gather_dense(comm, payload)
            scale_bytes = signs.scale.nbytes
            decode = [
                unsign_1bit(type(signs)(r[scale_bytes:], r[:scale_bytes].view(fed.dtype), fed.size)) for r in rows
            ]
            sent = unsign_1bit(signs)
        self.bytes_sent += float(allgather_bytes_per_rank(payload.nbytes, size))
        return np.sum(decode, axis=0, dtype=fed.dtype), sent

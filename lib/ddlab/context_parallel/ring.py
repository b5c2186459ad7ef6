"""Ring attention (Liu et al., "Ring Attention with Blockwise Transformers", 2023) over P ranks.

Each rank holds the queries, keys and values of its positions (`ddlab.context_parallel.layout`).
Forward, P steps: at each step a rank starts sending the key/value block it holds to rank+1 and
receiving the next from rank-1 (Isend/Irecv), computes its queries' partial result over the block
it holds meanwhile (`attend_block`), merges it into its running one (`merge_partials`), then waits:
after P steps its queries have met every block, and no rank ever held more than three blocks
of keys and values (its own, kept for the backward, the one it computes on, the one arriving).
Backward, P steps again: the key/value blocks go round once more, each with the gradients of
its keys and values, which every rank adds its share to and passes on; after the last step
they arrive home. Messages per rank: P-1 blocks of K and V forward; P-1 blocks of K and V
and P of their gradients backward (none on one rank).

`positions` is a (P, n) array of every rank's global positions (the same on every rank), so the
causal mask of the block that came from rank s uses positions[s]. With causal=False every query
sees every key (padding rows included: use it on lengths 2P divides); the messages are the same. Every wait has a deadline
(`ddlab.runtime.waiting`): a ring that deadlocks raises `Stalled` instead of hanging.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..runtime.comm import Comm
from ..runtime.counting import CountingComm, underlying
from ..runtime.reference import reference
from ..runtime.waiting import Stalled, Watch
from .blockwise import Partial, attend_block, attend_block_backward, empty_partial, finish, merge_partials
from .layout import all_positions

#: Tags of the ring's messages: key/value blocks, and their gradients.
TAG_KV, TAG_GRAD = 150, 151


@reference("ring_attention", "ring_attention_backward")
class Ring:
    """One rank's view of the ring: its neighbours, and a deadline for every wait (a collective to create)."""

    def __init__(self, comm: Comm, timeout: float = 60.0):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.next, self.previous = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        # a check's CountingComm has its own watch (and deadline); a real communicator gets one here
        self._own = not isinstance(comm, CountingComm)
        self.watch = comm.watch if isinstance(comm, CountingComm) else Watch(underlying(comm), timeout)

    def shift(self, send: np.ndarray, tag: int) -> tuple[np.ndarray, list[MPI.Request]]:
        """Start sending `send` to the next rank and receiving its like from the previous: (buffer, requests)."""
        incoming = np.empty_like(send)
        requests = [self.comm.Irecv(incoming, self.previous, tag), self.comm.Isend(send, self.next, tag)]
        return incoming, requests

    def wait(self, requests: list[MPI.Request], what: str) -> None:
        """Wait for requests, or raise Stalled at the deadline (and tell the other ranks)."""
        try:
            self.watch.poll(lambda: MPI.Request.Testall(requests), what)
        except Stalled as err:
            self.watch.fail_all(str(err))
            raise

    def free(self) -> None:
        """Release the ring's own watch (a collective). Failure notices still in flight are taken in
        first: one left on a freed communicator would reach the next one MPI gives the same id."""
        if self._own:
            self.watch.settle()
            self.watch.free()


def _check(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, size: int) -> np.ndarray:
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k and v must have one shape (..., n, d), got {q.shape}, {k.shape}, {v.shape}")
    positions = np.asarray(positions)
    if positions.shape != (size, q.shape[-2]):
        raise ValueError(
            f"positions must be a ({size}, {q.shape[-2]}) array, every rank's positions (see layout.all_positions), "
            f"got shape {positions.shape}"
        )
    return positions


@reference("ring_attention")
def ring_attention(
    comm: Comm,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    positions: np.ndarray,
    overlap: bool = True,
    causal: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention of this rank's queries over every rank's keys, causal unless told: (output, log-sum-exp per row).

    overlap=False waits for each block to arrive before computing (to measure what overlap saves).
    """
    ring = Ring(comm)
    try:
        positions = _check(q, k, v, positions, ring.size)
        # one message per step: this block's keys and values, C-contiguous whatever the inputs' strides
        # (np.stack keeps their memory order, and MPI refuses a non-contiguous buffer)
        held = np.ascontiguousarray(np.stack([k, v]))
        partial: Partial = empty_partial(q, v.shape[-1])
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            last = step == ring.size - 1
            if not last:
                incoming, requests = ring.shift(held, TAG_KV)
                if not overlap:
                    ring.wait(requests, f"key/value block {step + 1} to move round the ring")
            block = attend_block(q, held[0], held[1], positions[ring.rank], positions[source], causal)
            partial = merge_partials(partial, block)
            if not last:
                ring.wait(requests, f"key/value block {step + 1} to move round the ring")
                held = incoming
        return finish(partial)
    finally:
        ring.free()


@reference("ring_attention_backward")
def ring_attention_backward(
    comm: Comm,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    grad_out: np.ndarray,
    positions: np.ndarray,
    causal: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv) of this rank's rows: the blocks go round again, their gradients travelling with them."""
    ring = Ring(comm)
    try:
        positions = _check(q, k, v, positions, ring.size)
        delta = np.sum(grad_out * out, axis=-1)
        held = np.ascontiguousarray(np.stack([k, v]))  # as in the forward: MPI needs contiguous buffers
        grads = np.zeros_like(held)  # the gradients of the block held, as accumulated so far
        dq = np.zeros_like(q)
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            last = step == ring.size - 1
            requests: list[MPI.Request] = []
            if not last:
                incoming, requests = ring.shift(held, TAG_KV)
            share = attend_block_backward(
                q, held[0], held[1], grad_out, lse, delta, positions[ring.rank], positions[source], causal
            )
            dq += share[0]
            grads[0] += share[1]
            grads[1] += share[2]
            if ring.size > 1:  # pass the gradients on: after the last step they reach their block's owner
                arriving, sent = ring.shift(grads, TAG_GRAD)
                requests += sent
            ring.wait(requests, f"step {step} of the backward ring (blocks and their gradients)")
            if ring.size > 1:
                grads = arriving
            if not last:
                held = incoming
        return dq, grads[0].copy(), grads[1].copy()
    finally:
        ring.free()


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd function: forward keeps q, k, v, the output and the log-sum-exp only."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, positions: np.ndarray
    ) -> torch.Tensor:
        out, lse = ring_attention(comm, q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), positions)
        out_t, lse_t = torch.from_numpy(out), torch.from_numpy(lse)
        ctx.save_for_backward(q, k, v, out_t, lse_t)
        ctx.comm, ctx.positions = comm, positions
        return out_t

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = (t.detach().numpy() for t in ctx.saved_tensors)
        grads = ring_attention_backward(
            ctx.comm, q, k, v, out, lse, grad_out.detach().contiguous().numpy(), ctx.positions
        )
        return (*(torch.from_numpy(g) for g in grads), None, None)


def ring_attention_torch(
    comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: np.ndarray
) -> torch.Tensor:
    """Ring attention on tensors (..., n, d) that autograd differentiates: this rank's output rows."""
    return RingAttention.apply(q, k, v, comm, positions)


def ring_attention_heads(comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Ring attention of `heads` heads on this rank's zig-zag rows: q, k, v (B, n, heads x d) -> (B, n, heads x d).

    The n rows are this rank's `zigzag_positions(n P, P, rank)` of sequences n P long (n P a multiple
    of 2P, no padding): the layout lab 16's mesh gives its context ranks. Differentiable (autograd)."""
    batch, rows, width = q.shape
    size = comm.Get_size()
    if (rows * size) % (2 * size):
        raise ValueError(f"{rows} rows per rank are not 2 zig-zag chunks of a sequence of {rows * size}: use an even n")
    d = width // heads

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, rows, heads, d).transpose(1, 2).contiguous()  # (B, heads, n, d)

    out = ring_attention_torch(comm, split(q), split(k), split(v), all_positions(rows * size, size))
    return out.transpose(1, 2).reshape(batch, rows, width)

"""The halo exchange: the rows a convolution needs from the neighbouring slabs, as an autograd function.

A k x k convolution (k odd) reads p = k // 2 rows above and below each output row.
On a slab, the first and last p output rows need rows that the ranks above and below
hold: the *halo*. Forward, each rank sends its top p rows to the rank above and its
bottom p rows to the rank below, and receives theirs. Backward, the gradient that
reached a halo row belongs to the rank that owns that row: it goes back, and the
owner adds it to the gradient of its boundary rows. Ranks at the image's top and
bottom edge get zeros for the missing halo, like the zero padding of one process.

Exercise 8.1 signature: `HaloExchange.apply(x, comm, halo) -> (above, below)`: x is
this rank's slab (N, C, h, W) with h >= halo >= 1; above and below are (N, C, halo, W):
the last `halo` rows of rank-1's slab and the first `halo` rows of rank+1's (zeros at the
edges). Messages: one to each neighbour forward (its rows), one to each neighbour
backward (the halo's gradient), each halo x W x C x N x itemsize bytes; none to itself.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from mpi4py import MPI

from ..runtime.comm import Comm
from ..runtime.counting import CountingComm
from ..runtime.reference import reference

TIMEOUT = 60.0
FORWARD_TAGS, BACKWARD_TAGS = (81, 82), (83, 84)  # (going up, going down)


def wait_all(comm: Comm, requests: list[MPI.Request], what: str, timeout: float = TIMEOUT) -> None:
    """Wait for requests, giving up after timeout seconds (or when a CountingComm hears of a failure)."""
    if isinstance(comm, CountingComm):
        comm.wait(requests, what)
        return
    deadline, spins = time.monotonic() + timeout, 0
    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}: does every rank of the slab run the same layers?")
        spins += 1
        if spins > 1000:
            time.sleep(1e-4)


@reference("halo_exchange")
def exchange_rows(
    comm: Comm,
    to_above: torch.Tensor,
    to_below: torch.Tensor,
    tags: tuple[int, int],
    rows: tuple[int, int] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Send to_above to rank-1 and to_below to rank+1 (where they exist); return what they sent back.

    Returns (from_above, from_below), None at an edge. `rows` = (rows coming from above, from
    below), by default to_above's row count for both; a side of 0 rows sends and receives no
    message (the halos of a strided window differ: `SpatialMaxPool`). The tensors are
    (N, C, rows, W). `tags` = (tag of messages going up, tag of messages going down).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    up, down = tags
    n, c, _, w = to_above.shape
    expected = (to_above.shape[2], to_above.shape[2]) if rows is None else rows
    received: list[torch.Tensor | None] = [None, None]
    requests, outgoing = [], []
    for i, (peer, tag) in enumerate(((rank - 1, down), (rank + 1, up))):
        if 0 <= peer < size and expected[i]:
            buffer = torch.empty(n, c, expected[i], w, dtype=to_above.dtype)
            received[i] = buffer
            requests.append(comm.Irecv(buffer.numpy(), source=peer, tag=tag))
    for peer, sent, tag in ((rank - 1, to_above, up), (rank + 1, to_below, down)):
        if 0 <= peer < size and sent.shape[2]:
            outgoing.append(sent.detach().contiguous().numpy())  # alive until the send completes
            requests.append(comm.Isend(outgoing[-1], dest=peer, tag=tag))
    wait_all(comm, requests, f"the halo exchange of rank {rank} with its neighbours")
    return received[0], received[1]


class HaloExchange(torch.autograd.Function):
    """Forward: the neighbours' boundary rows (above, below). Backward: their gradients go home."""

    @staticmethod
    @reference("halo_exchange")
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, halo: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 1 <= halo <= x.shape[2]:
            raise ValueError(f"a halo of {halo} rows needs 1 <= halo <= the slab's {x.shape[2]} rows")
        ctx.comm, ctx.halo, ctx.rows = comm, halo, x.shape[2]
        above, below = exchange_rows(comm, x[:, :, :halo], x[:, :, -halo:], FORWARD_TAGS)
        zeros = x.new_zeros(x.shape[0], x.shape[1], halo, x.shape[3])
        return (zeros if above is None else above), (zeros.clone() if below is None else below)

    @staticmethod
    @reference("halo_exchange")
    def backward(ctx: Any, grad_above: torch.Tensor, grad_below: torch.Tensor) -> tuple:
        halo = ctx.halo
        from_above, from_below = exchange_rows(ctx.comm, grad_above, grad_below, BACKWARD_TAGS)
        n, c, _, w = grad_above.shape
        grad_x = grad_above.new_zeros(n, c, ctx.rows, w)
        if from_above is not None:
            grad_x[:, :, :halo] += from_above
        if from_below is not None:
            grad_x[:, :, -halo:] += from_below
        return grad_x, None, None
